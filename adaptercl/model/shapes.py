"""The shape of a decoder-only model and what its parts weigh: the inputs of the memory plan (`plan/memory.py`).

    shape = shape_of("Qwen/Qwen2.5-7B-Instruct"); base_bytes(shape, "nf4"); lora_params(shape, stage)

A shape comes from `SHAPES` (known architectures, from each model's config.json) or a local folder's config.json,
never from the hub; a run reads its loaded model's config (`shape_from_config`). `kv_bytes` is the bf16 KV cache of
some tokens. `read_model_config` is how every module reads a model folder's config.json: one that does not parse (a
hub page saved from a `/blob/` link is HTML) is one line naming it. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptercl.recipe import RecipeError, StageConfig
from adaptercl.system import read_record

GIB = 2**30
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # bitsandbytes NF4 with double quantisation: 4.127 bits per parameter


@dataclass(frozen=True)
class Shape:
    """What the memory model needs of a decoder-only transformer (Llama/Qwen2 layout)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)


# Hub ids (lower case, without "-instruct") -> shape, from each model's config.json.
SHAPES: dict[str, Shape] = {
    "qwen/qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "qwen/qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen/qwen2.5-3b": Shape(2048, 11008, 36, 16, 2, 151936, True),
    "qwen/qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen/qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 152064, False),
    "huggingfacetb/smollm2-135m": Shape(576, 1536, 30, 9, 3, 49152, True),
}
SHAPES["smollm2-135m"] = SHAPES["huggingfacetb/smollm2-135m"]  # the built-in alias smollm2-135m-instruct
SHAPES["tiny-random"] = Shape(64, 128, 2, 2, 1, 320, False)  # base.py's built-in 2-layer Qwen2


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


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A model's config.json (`path`: the file) as a dict; one that does not parse is a RecipeError naming it."""
    fix = (
        "it must be the model's own config.json: download it again with the hub's /resolve/ link or "
        "`huggingface-cli download` (a /blob/ link saves the web page)"
    )
    return read_record(path, fix)


def shape_from_config(cfg: dict, where: str) -> Shape:
    """The shape of a transformers config (config.json's fields, or a loaded model's `config.to_dict()`)."""
    try:
        return Shape(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                     cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                     cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))  # fmt: skip
    except KeyError as err:
        raise RecipeError(f"model.name: {where} lacks {err.args[0]!r} (Llama/Qwen2 layout)") from None


def base_bytes(shape: Shape, quantization: str, nf4_bits: float = NF4_BITS) -> float:
    """The frozen base: NF4 linears (`nf4_bits` a weight: the trainer's double-quantised copy by default) + bf16
    embeddings/lm_head, or all bf16."""
    bits = nf4_bits if quantization in ("nf4", "auto") else 16
    norms = (2 * shape.layers + 1) * shape.hidden
    return shape.linear_params() * bits / 8 + (shape.embedding_params() + norms) * 2


def lora_params(shape: Shape, stage: StageConfig, rank: int | None = None) -> int:
    """LoRA parameters of one adapter: r x (in + out) per adapted projection per adapted layer."""
    # auto and all-linear on the Llama/Qwen2 layout the shape describes: its seven projections
    targets = ALL_LINEAR if isinstance(stage.lora.target_modules, str) else stage.lora.target_modules
    layers = len(stage.lora.layers) if stage.lora.layers is not None else shape.layers
    per_layer = sum(a + b for name, (a, b) in shape.linear_shapes().items() if name in targets)
    return (rank or stage.lora.r) * per_layer * layers


def kv_bytes(shape: Shape, tokens: int) -> float:
    """bf16 keys and values of `tokens` tokens over every layer."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * tokens


def gib(terms: dict[str, float]) -> float:
    """The GiB of a dict of byte terms."""
    return sum(terms.values()) / GIB
