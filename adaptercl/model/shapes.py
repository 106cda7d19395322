"""The shape of a decoder-only model and what its parts weigh: the inputs of the memory plan (`plan/memory.py`).

    shape = shape_of("Qwen/Qwen2.5-7B-Instruct"); base_bytes(shape, "nf4"); lora_params(shape, stage)

A shape comes from `SHAPES` (known architectures, from each model's config.json: Qwen2.5, Qwen3 and the hybrid
Qwen3.5, whose Gated DeltaNet layers keep a fixed recurrent state instead of a KV cache) or a local folder's
config.json, never from the hub; a run reads its loaded model's config (`shape_from_config`). `kv_bytes` is the bf16
KV cache of some tokens, `recurrent_state_bytes` the Gated DeltaNet state of some sequences. `model_type_of` is a
base's config.json model_type as far as it is known without a download. `read_model_config` is how every module
reads a model folder's config.json: one that does not parse (a hub page saved from a `/blob/` link is HTML) is one line
naming it. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptercl.recipe import RecipeError, StageConfig
from adaptercl.system import read_record

GIB = 2**30
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# lora.target_modules auto (`model/lora_targets.py` resolves it on the loaded model; the plan counts it here):
# role -> the projection names transformers' families give it
AUTO_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
    "linear attention": ("in_proj_qkv", "in_proj_qkvz", "in_proj_z", "out_proj"),
    "MLP": ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
}
AUTO = frozenset(name for names in AUTO_TARGETS.values() for name in names)
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # bitsandbytes NF4 with double quantisation: 4.127 bits per parameter


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3-Next: `layer_types` "linear_attention"), as
    transformers 5.23 builds them (`Qwen3_5GatedDeltaNet`): in_proj_qkv (hidden -> 2 x key + value), in_proj_z
    (hidden -> value), in_proj_b and in_proj_a (hidden -> value heads), out_proj (value -> hidden), a depthwise conv1d
    over the 2 x key + value channels; per sequence a float32 recurrent state [value heads, key dim, value dim] and a
    conv state [channels, kernel] in the compute dtype instead of a KV cache."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_width + self.value_width


@dataclass(frozen=True)
class Shape:
    """What the memory model needs of a decoder-only transformer: the Llama/Qwen2 layout, with an explicit head_dim
    (Qwen3, Qwen3.5), a gated q_proj (Qwen3.5) and Gated DeltaNet layers among the attention ones (hybrids)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    attn_head_dim: int = 0  # config.json's head_dim; 0: hidden // heads
    q_gate: bool = False  # q_proj also outputs an output gate of heads x head_dim (GATED_ATTENTION)
    layer_types: tuple[str, ...] = ()  # per decoder layer, as config.json's layer_types; (): every layer attention
    linear: LinearAttention | None = None  # the "linear_attention" layers' dimensions
    model_type: str = ""  # config.json's model_type ("" unknown): what vLLM's LoRA support is looked up by

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden // self.heads

    def is_linear_attention(self, index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[index] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> int:
        """Layers that keep a KV cache: all but the Gated DeltaNet ones."""
        return self.layers - sum(self.is_linear_attention(i) for i in range(self.layers))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one attention layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q * (2 if self.q_gate else 1)), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def layer_shapes(self, index: int) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of decoder layer `index`: an attention layer's, or a Gated DeltaNet's (with
        the same MLP)."""
        shapes = self.linear_shapes()
        if not self.is_linear_attention(index):
            return shapes
        h, la = self.hidden, self.linear
        mlp = {name: shapes[name] for name in ("gate_proj", "up_proj", "down_proj")}
        return {"in_proj_qkv": (h, la.conv_channels), "in_proj_z": (h, la.value_width),
                "in_proj_b": (h, la.value_heads), "in_proj_a": (h, la.value_heads),
                "out_proj": (la.value_width, h), **mlp}  # fmt: skip

    def linear_params(self) -> int:
        return sum(a * b for i in range(self.layers) for a, b in self.layer_shapes(i).values())

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def unquantized_params(self) -> int:
        """What stays in the compute dtype beside the embeddings: the RMSNorms (two a layer and the final one) and
        the Gated DeltaNet layers' conv1d weights (bitsandbytes quantises nn.Linear only)."""
        linear = self.layers - self.attention_layers
        conv = linear * self.linear.conv_channels * self.linear.conv_kernel if linear else 0
        return (2 * self.layers + 1) * self.hidden + conv

    def adapted_weights(self, targets: list[str] | str, layers: list[int] | None = None) -> list[tuple[int, int]]:
        """(in, out) of every weight LoRA adapts: `targets` the recipe's target_modules ("all-linear": every
        projection of each layer, Gated DeltaNet ones included, as PEFT's all-linear; "auto": the attention and MLP
        projections `model.lora_targets` resolves, in_proj_a/in_proj_b left out), `layers` its lora.layers (0-based,
        negative from the top; None: all)."""
        indices = sorted({i % self.layers for i in layers}) if layers is not None else range(self.layers)
        chosen = {"all-linear": lambda name: True, "auto": lambda name: name in AUTO}.get(
            targets if isinstance(targets, str) else "", lambda name: name in targets
        )
        return [dims for i in indices for name, dims in self.layer_shapes(i).items() if chosen(name)]


LINEAR_ATTENTION = "linear_attention"
# model_types whose full-attention q_proj outputs heads x head_dim x 2 (query and a sigmoid output gate):
# transformers 5.23 Qwen3_5Attention and Qwen3NextAttention build it so whatever the config says.
GATED_ATTENTION = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_next"})


def _hybrid(layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3.5's default layer_types: every `interval`-th layer full attention, the others Gated DeltaNet
    (transformers' Qwen3_5TextConfig, full_attention_interval 4)."""
    return tuple("full_attention" if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))


# Hub ids (lower case, without "-instruct") -> shape, from each model's config.json.
SHAPES: dict[str, Shape] = {
    "qwen/qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True, model_type="qwen2"),
    "qwen/qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True, model_type="qwen2"),
    "qwen/qwen2.5-3b": Shape(2048, 11008, 36, 16, 2, 151936, True, model_type="qwen2"),
    "qwen/qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False, model_type="qwen2"),
    "qwen/qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 152064, False, model_type="qwen2"),
    "huggingfacetb/smollm2-135m": Shape(576, 1536, 30, 9, 3, 49152, True, model_type="llama"),
    # Qwen3 (the SDPO and SRPO papers' models), config.json of huggingface.co/Qwen/Qwen3-4B and /Qwen/Qwen3-8B
    # (architectures Qwen3ForCausalLM; head_dim 128 set explicitly, so q_proj is 32 x 128 = 4096 wide at hidden
    # 2560; the 4B ties its embeddings, the 8B does not); their model cards agree (36 layers, 32 Q / 8 KV heads).
    # Qwen3-4B-Instruct-2507 is the same network (its config.json differs in max_position_embeddings only).
    "qwen/qwen3-4b": Shape(2560, 9728, 36, 32, 8, 151936, True, attn_head_dim=128, model_type="qwen3"),
    "qwen/qwen3-8b": Shape(4096, 12288, 36, 32, 8, 151936, False, attn_head_dim=128, model_type="qwen3"),
    # Qwen3.5 (hybrid: Gated DeltaNet x 3 + gated full attention, repeating), text_config of the config.json of
    # huggingface.co/Qwen/Qwen3.5-4B and /Qwen/Qwen3.5-9B (architectures Qwen3_5ForConditionalGeneration, model_type
    # qwen3_5; transformers 5.23 loads the text model alone as Qwen3_5ForCausalLM). 9B: transformers 5.23's
    # Qwen3_5TextConfig defaults are its text config; 4B: hidden 2560, intermediate 9216, tied embeddings, the same
    # attention and Gated DeltaNet heads. Both agree with radixark/miles scripts/models/qwen3.5-{4B,9B}.sh (Megatron
    # arguments: 32 layers, 16 heads, 4 query groups, kv-channels 256, untied for the 9B only, vocab 248320).
    "qwen/qwen3.5-4b": Shape(
        2560,
        9216,
        32,
        16,
        4,
        248320,
        True,
        attn_head_dim=256,
        q_gate=True,
        layer_types=_hybrid(32),
        linear=LinearAttention(16, 32, 128, 128, 4),
        model_type="qwen3_5",
    ),  # fmt: skip
    "qwen/qwen3.5-9b": Shape(
        4096,
        12288,
        32,
        16,
        4,
        248320,
        False,
        attn_head_dim=256,
        q_gate=True,
        layer_types=_hybrid(32),
        linear=LinearAttention(16, 32, 128, 128, 4),
        model_type="qwen3_5",
    ),  # fmt: skip
}
SHAPES["qwen/qwen3-4b-instruct-2507"] = SHAPES["qwen/qwen3-4b"]
SHAPES["smollm2-135m"] = SHAPES["huggingfacetb/smollm2-135m"]  # the built-in alias smollm2-135m-instruct
SHAPES["tiny-random"] = Shape(64, 128, 2, 2, 1, 320, False, model_type="qwen2")  # base.py's built-in 2-layer Qwen2


def shape_of(model_name: str) -> Shape:
    """The shape of a known hub id or of a local folder's config.json; RecipeError otherwise (no download)."""
    folder = Path(model_name)
    if (folder / "config.json").is_file():
        return shape_from_config(read_model_config(folder / "config.json"), f"{folder}/config.json")
    key = model_name.lower().removesuffix("-instruct")
    if key not in SHAPES:
        raise RecipeError(
            f"model.name: {model_name!r} is not in the plan's table of shapes ({', '.join(sorted(SHAPES))}); "
            "point model.name at a local folder with its config.json (nothing is downloaded)"
        )
    return SHAPES[key]


def model_type_of(model_name: str, revision: str | None = None) -> str | None:
    """config.json's model_type of a base, without loading or downloading it: a known hub id or alias (`SHAPES`), a
    local folder's config.json, a hub id's config.json in the local hub cache; None when none of them says."""
    folder = Path(model_name).expanduser()
    if (folder / "config.json").is_file():
        return read_model_config(folder / "config.json").get("model_type")
    shape = SHAPES.get(model_name.lower().removesuffix("-instruct"))
    if shape is not None:
        return shape.model_type or None
    if model_name.count("/") != 1 or model_name.startswith((".", "/", "~")):
        return None
    import huggingface_hub

    try:
        cached = huggingface_hub.try_to_load_from_cache(model_name, "config.json", revision=revision)
    except ValueError:  # not a valid repo id (HFValidationError): loading the base says so in its own line
        return None
    return read_model_config(cached).get("model_type") if isinstance(cached, str) else None


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A model's config.json (`path`: the file) as a dict; one that does not parse is a RecipeError naming it."""
    fix = (
        "it must be the model's own config.json: download it again with the hub's /resolve/ link or "
        "`huggingface-cli download` (a /blob/ link saves the web page)"
    )
    return read_record(path, fix)


def shape_from_config(cfg: dict, where: str) -> Shape:
    """The shape of a transformers config (config.json's fields, or a loaded model's `config.to_dict()`); a
    multimodal config.json's language model is its `text_config` (Qwen3.5, Gemma 3). Layer types other than
    "linear_attention" (Gated DeltaNet) are planned as full attention (a sliding window's KV cache as the whole
    sequence's: an upper bound)."""
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    model_type = cfg.get("model_type") or text.get("model_type") or ""
    try:
        layers = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or ())
        if not layer_types and "linear_num_value_heads" in text:  # Qwen3-Next style: the interval alone
            layer_types = _hybrid(layers, text.get("full_attention_interval", 4))
        linear = None
        if LINEAR_ATTENTION in layer_types:
            linear = LinearAttention(text["linear_num_key_heads"], text["linear_num_value_heads"],
                                     text["linear_key_head_dim"], text["linear_value_head_dim"],
                                     text["linear_conv_kernel_dim"])  # fmt: skip
        return Shape(text["hidden_size"], text["intermediate_size"], layers, text["num_attention_heads"],
                     text.get("num_key_value_heads") or text["num_attention_heads"], text["vocab_size"],
                     bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                     attn_head_dim=text.get("head_dim") or 0,
                     q_gate=bool({model_type, text.get("model_type")} & GATED_ATTENTION),
                     layer_types=layer_types if linear else (), linear=linear, model_type=model_type)  # fmt: skip
    except KeyError as err:
        raise RecipeError(f"model.name: {where} lacks {err.args[0]!r} (Llama/Qwen2 layout)") from None


def base_bytes(shape: Shape, quantization: str, nf4_bits: float = NF4_BITS) -> float:
    """The frozen base: NF4 linears (`nf4_bits` a weight: the trainer's double-quantised copy by default) + bf16
    embeddings/lm_head, norms and conv1d weights (`Shape.unquantized_params`), or all bf16."""
    bits = nf4_bits if quantization in ("nf4", "auto") else 16
    return shape.linear_params() * bits / 8 + (shape.embedding_params() + shape.unquantized_params()) * 2


def lora_params(shape: Shape, stage: StageConfig, rank: int | None = None) -> int:
    """LoRA parameters of one adapter: r x (in + out) per adapted weight (`Shape.adapted_weights`)."""
    adapted = shape.adapted_weights(stage.lora.target_modules, stage.lora.layers)
    return (rank or stage.lora.r) * sum(a + b for a, b in adapted)


def kv_bytes(shape: Shape, tokens: int) -> float:
    """bf16 keys and values of `tokens` tokens over every attention layer (a Gated DeltaNet layer keeps none:
    `recurrent_state_bytes`)."""
    return 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * 2 * tokens


def recurrent_state_bytes(shape: Shape, sequences: int) -> float:
    """What the Gated DeltaNet layers keep per sequence instead of a KV cache, whatever its length: the float32
    recurrent state [value heads, key dim, value dim] (transformers computes the delta rule in float32) and the
    bf16 conv state [channels, kernel]; 0 for a model without such layers."""
    la = shape.linear
    if la is None:
        return 0.0
    per_layer = la.value_heads * la.key_dim * la.value_dim * 4 + la.conv_channels * la.conv_kernel * 2
    return (shape.layers - shape.attention_layers) * per_layer * sequences


def gib(terms: dict[str, float]) -> float:
    """The GiB of a dict of byte terms."""
    return sum(terms.values()) / GIB
