"""Which modules of a base LoRA wraps: `lora.target_modules` resolved against the model itself, and checked.

    targets = resolve_lora_targets(model, "auto", layers=None)     # what PEFT's LoraConfig.target_modules gets

`auto` (the default) is every decoder layer's attention and MLP projections, by the names transformers gives them in
the families it ships (`shapes.AUTO_TARGETS`): q/k/v/o_proj (Phi-3's fused qkv_proj), gate/up/down_proj (Phi-3's fused
gate_up_proj, an MoE's shared expert), and in a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) the projections in the
roles of q/k/v and o: in_proj_qkv (Qwen3-Next: in_proj_qkvz), in_proj_z (the output gate) and out_proj. Left at the
base's values, as routers and norms are: the DeltaNet's in_proj_a / in_proj_b (Qwen3-Next: in_proj_ba),
one output per value head that sets how fast the recurrent state decays and how strongly a token is written (a
rank-r update there is nearly full rank and changes the recurrence itself), Gemma 4's per-layer-input projections,
an MoE's router and shared-expert gate. Routed MoE experts are not trained: transformers 5.x stores them fused as
3-D parameters, which LoRA's module wrappers cannot reach; `auto` also leaves out experts kept as separate linear
modules (under an `experts` module), and `all-linear` on such a model is refused: it would wrap every expert.
Name any of these in `lora.target_modules` to train them. One more exception, PEFT's: on the MoE families whose
adapters it converts from transformers v4's expert names (Qwen3-MoE, Qwen3-Next, DeepSeek, OLMoE, GLM-4-MoE and the
rest of transformers' qwen2_moe pattern; `peft.utils.transformers_weight_conversion`), any target named gate_proj,
up_proj or down_proj is moved onto the fused routed experts' parameters, so a shared expert's or a dense layer's MLP
cannot be named there: `auto` and `all-linear` leave those out, and a list naming them is refused
(`_peft_redirects`).

A list is matched as PEFT matches it (a module's full name or a dot-suffix of it); a list, or one of its names,
that matches no module, or only modules LoRA cannot wrap, or none in the layers `lora.layers` keeps, is refused in one
line naming the model's linear layers (and a hybrid model's layer types). `auto` and `all-linear` come back as the
suffixes they match, or as full module names where a suffix would also reach a module they leave out (a vision
tower's q_proj, an expert's gate_proj), so PEFT wraps exactly the modules chosen here. `check_lora_targets` runs the
same resolution on the base's skeleton (`architecture.py`) before a run writes anything.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from peft import LoraConfig as PeftLoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
from transformers.pytorch_utils import Conv1D

from adaptercl.model.lora_layers import describe_layer_types, lora_layer_indices
from adaptercl.model.shapes import AUTO
from adaptercl.recipe import RecipeConfig, RecipeError

EXPERTS = "experts"  # the module name under which MoE blocks keep their routed experts
WRAPPABLE = (torch.nn.Linear, Conv1D, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def resolve_lora_targets(
    model: torch.nn.Module, target_modules: str | list[str], layers: list[int] | None, field: str = "lora"
) -> list[str]:
    """PEFT's `target_modules` for `lora.target_modules` on `model` (PEFT-wrapped or not) with LoRA only in the
    decoder layers `layers` (0-based, None: all); a RecipeError naming `field`.target_modules when it cannot be
    resolved (module docstring)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = wrappable_modules(base)
    layer_of = decoder_layer_of(base, modules)
    where = _Where(base, layers, layer_of, f"{field}.target_modules")
    if isinstance(target_modules, list):
        for target in target_modules:
            _check_one(base, target, modules, where)
        redirected = _peft_redirects(base, target_modules, where)
        if redirected:
            raise RecipeError(
                f"{where.field}: PEFT moves {', '.join(sorted(redirected))} of a {base.config.model_type} model onto "
                "its fused routed experts, which adaptercl does not train; leave them out (or use auto)"
            )
        return list(target_modules)
    linear = {n for n, m in modules.items() if _is_linear(m) and n not in _output_embedding(base)}
    kept = {n for n in linear if layers is None or layer_of.get(n) in layers}
    if target_modules == "all-linear":
        experts = sorted(n for n in kept if EXPERTS in n.split("."))
        if experts:
            raise RecipeError(
                f"{where.field}: all-linear would wrap every routed expert of {where.model} ({len(experts)} expert "
                f"modules, e.g. {experts[0]}); use auto (attention and MLP projections, experts left as they are) "
                "or list the modules to train"
            )
        chosen = kept
    else:
        chosen = {n for n in kept if n in layer_of and _suffix(n) in AUTO and EXPERTS not in n.split(".")}
    redirected = _peft_redirects(base, sorted({_suffix(n) for n in chosen}), where)
    chosen = {n for n in chosen if _suffix(n) not in redirected}
    if not chosen:
        raise RecipeError(
            f"{where.field}: {target_modules} knows no attention or MLP projection of {where.model}"
            f"{where.in_layers()}; name its layers to train in {where.field}: {where.linear_names(modules)}"
        )
    return _as_peft_targets(chosen, modules, layers)


def wrappable_modules(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Full name -> module of every module LoRA can wrap (linear, Conv1D, embedding, convolution), a layer PEFT
    already wraps counted once under its own name (not its base_layer or adapters)."""
    out: dict[str, torch.nn.Module] = {}
    tuned: list[str] = []
    for name, module in base.named_modules():
        if any(name.startswith(t + ".") for t in tuned):
            continue
        if isinstance(module, BaseTunerLayer):
            tuned.append(name)
            out[name] = module
        elif isinstance(module, WRAPPABLE):
            out[name] = module
    return out


def decoder_layer_of(base: torch.nn.Module, names: Iterable[str]) -> dict[str, int]:
    """Module name -> index of the decoder layer holding it, for the modules among `names` inside one."""
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    stack = getattr(decoder, "layers", None)
    if not isinstance(stack, torch.nn.ModuleList):
        return {}
    by_id = {id(layer): i for i, layer in enumerate(stack)}
    prefixes = {name: by_id[id(m)] for name, m in base.named_modules() if id(m) in by_id}
    out = {}
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            index = prefixes.get(".".join(parts[:cut]))
            if index is not None:
                out[name] = index
                break
    return out


def layer_types(model: torch.nn.Module) -> list[str] | None:
    """The decoder's `layer_types` (a hybrid's linear and full attention, a sliding window's) of a causal LM
    (PEFT-wrapped or not), None if unset."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    types = getattr(config, "layer_types", None)
    return list(types) if types else None


class _Where:
    """What an error line says about the model and the layers it looked in."""

    def __init__(self, base: torch.nn.Module, layers: list[int] | None, layer_of: dict[str, int], field: str):
        self.model, self.layers, self.layer_of, self.field = type(base).__name__, layers, layer_of, field
        self.types = describe_layer_types(layer_types(base))
        self.head = _output_embedding(base)

    def in_layers(self) -> str:
        parts = ([f"lora.layers {self.layers}"] if self.layers is not None else []) + (
            [f"layer types: {self.types}"] if self.types else []
        )
        return f" ({'; '.join(parts)})" if parts else ""

    def linear_names(self, modules: dict[str, torch.nn.Module]) -> str:
        """The linear layers' names (suffixes) but the LM head's, in the layers kept when `lora.layers` is set."""
        names = sorted(
            {
                _suffix(n)
                for n, m in modules.items()
                if _is_linear(m)
                and n not in self.head
                and (self.layers is None or self.layer_of.get(n) in self.layers)
            }
        )
        return ", ".join(names) if names else "(none)"


def _check_one(base: torch.nn.Module, target: str, modules: dict[str, torch.nn.Module], where: _Where) -> None:
    """One name of a `target_modules` list: it matches a module LoRA can wrap, in the layers kept."""
    config = PeftLoraConfig(target_modules=[target])
    named = [n for n, _ in base.named_modules() if n and check_target_module_exists(config, n)]
    there = " there" if where.layers is not None else ""
    fix = f"its linear layers{there} are {where.linear_names(modules)} (or use auto)"
    if not named:
        raise RecipeError(f"{where.field}: {target!r} matches no module of {where.model}; {fix}")
    wrappable = [n for n in named if n in modules]
    if not wrappable:
        kinds = sorted({type(base.get_submodule(n)).__name__ for n in named})
        fused = (
            " (routed MoE experts are fused 3-D weights in transformers 5.x)"
            if any("Experts" in k for k in kinds)
            else ""
        )
        raise RecipeError(
            f"{where.field}: {target!r} names {', '.join(kinds)} modules of {where.model}, which LoRA cannot wrap"
            f"{fused}; {fix}"
        )
    if where.layers is not None and not any(where.layer_of.get(n) in where.layers for n in wrappable):
        raise RecipeError(f"{where.field}: {target!r} is in no layer of {where.model}{where.in_layers()}; {fix}")


def _peft_redirects(base: torch.nn.Module, targets: list[str], where: _Where) -> set[str]:
    """The names among `targets` PEFT would move onto fused expert parameters as it attaches an adapter (its
    transformers v4 -> v5 MoE conversion, run here on a copy of the config); a RecipeError for a set it refuses."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    config = PeftLoraConfig(target_modules=list(targets))
    try:
        convert_peft_config_for_transformers(config, base, None)
    except ValueError as err:  # a fused pair named by half (gate_proj without up_proj)
        raise RecipeError(f"{where.field}: {err}".replace("\n", " ")) from None
    if not config.target_parameters:
        return set()
    return set(targets) - set(config.target_modules or ())


def _as_peft_targets(chosen: set[str], modules: dict[str, torch.nn.Module], layers: list[int] | None) -> list[str]:
    """`chosen` as PEFT target names: their suffixes where PEFT would match exactly `chosen` with them (with
    `layers` as its layers_to_transform), else the full names."""
    suffixes = sorted({_suffix(n) for n in chosen})
    config = PeftLoraConfig(target_modules=suffixes, layers_to_transform=layers)
    if {n for n in modules if check_target_module_exists(config, n)} == chosen:
        return suffixes
    return sorted(chosen)


def _is_linear(module: torch.nn.Module) -> bool:
    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    return isinstance(module, (torch.nn.Linear, Conv1D))


def _output_embedding(base: torch.nn.Module) -> set[str]:
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return {n for n, m in base.named_modules() if head is not None and m is head}


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def check_lora_targets(recipe: RecipeConfig, download: bool = False) -> None:
    """Every stage's `lora.target_modules` and `lora.layers` resolved on the base's skeleton
    (`skeleton.base_skeleton`, which also refuses an architecture transformers does not know): the first that
    cannot be is a RecipeError naming its stage's field. Nothing more when the base's config is not known here (a
    GGUF file, a hub id not in the local cache): each adapter is resolved again as it is attached."""
    from adaptercl.model.skeleton import base_skeleton

    skeleton = base_skeleton(recipe.model, download)
    if skeleton is None:
        return
    count, types = decoder_layer_count(skeleton), layer_types(skeleton)
    for stage in recipe.stages:
        field, lora = f"stages.{stage.name}.lora", stage.lora
        layers = None
        if lora.layers is not None and count is not None:
            layers = lora_layer_indices(lora.layers, count, f"{field}.layers", recipe.model.name, types)
        resolve_lora_targets(skeleton, lora.target_modules, layers, field)


def decoder_layer_count(model: torch.nn.Module) -> int | None:
    """The decoder layers of a causal LM (PEFT-wrapped or not), from its text config."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return getattr(config, "num_hidden_layers", None)
