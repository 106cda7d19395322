"""`rollout.dtype`: the precision of the hf engine's sampled rollouts on a CPU, decided once per engine, checked
against this machine before anything loads, and recorded with the run's other CPU paths (the run directory's
cpu_paths.jsonl, one line per start of the run).

    check_rollout_dtype(recipe)           # preflight, torch-free: bfloat16 on a CPU without bf16 units is one line
    dtype = rollout_dtype("auto", model)  # torch.bfloat16 or torch.float32 for `HFEngine(dtype=...)`
    record = cpu_paths(dtype, model)      # MKL's branch, the packed-weight path and its choice, the dtype

`float32` (the default) samples from the trainer's own weights: exactly on-policy. `bfloat16` samples from bf16 copies
of the linear weights, packed for oneDNN (`packed_weights.py`), the LoRA folded in first in float32 (`fold_lora`);
the engine returns the sampler's logprobs and the trainer's rollout-mismatch weights min(exp(logp − logp_rollout), 2)
correct the difference (`hf.py`). `auto` is bfloat16 where the CPU has bf16 matrix units (AMX-BF16, AVX512-BF16),
torch's kernels use them (its CPU capability is AVX512) and oneDNN's bf16 product passes its probe, for a float32
model on the CPU; float32 elsewhere. Evidence (2-core AMD EPYC, Zen 4, AVX512-BF16): against the float32 trainer a
mean |log ratio| of 0.027 per token and IS weights 1.00 ± 0.04 (1-99 %: 0.90-1.12, none clipped; cpu_paths.py);
the quickstart learns as much on bf16 rollouts as on float32 ones at seeds 0 and 1 (arithmetic +0.333 / +0.367 and
+0.333 / +0.300 at n 30; benchmarks/quickstart/results.md), and its whole run with the model cached takes 1:36 against
1:45 (two runs each, interleaved, at 99af00e). recipes/quickstart.yaml therefore uses auto; the field's default stays
float32, the exactly on-policy reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from adaptercl.recipe import RecipeConfig, RecipeError
from adaptercl.system import BF16_UNITS, CPUINFO, bf16_units, cpu_fields

if TYPE_CHECKING:
    import torch

ROLLOUT_DTYPES = ("float32", "bfloat16")  # what `rollout.dtype` resolves to (auto: one of them, `rollout_dtype`)


def check_rollout_dtype(recipe: RecipeConfig, cuda_devices: int | None = None) -> None:
    """`rollout.dtype: bfloat16` where the hf engine rolls out on this machine's CPU (no CUDA device; engine hf or
    auto, which resolves to hf without one) needs a CPU with bf16 matrix units: else one RecipeError line naming the
    flags it lacks. Torch-free (preflight)."""
    rollout = recipe.stages[0].rollout  # one engine, one dtype for the run (the grammar checks)
    if rollout.dtype != "bfloat16" or rollout.engine not in ("hf", "auto"):
        return
    if cuda_devices is None:
        from adaptercl.rollout.engine_choice import cuda_device_count

        cuda_devices = cuda_device_count()
    if cuda_devices > 0:  # the run is on the GPU: the model's dtype there (the field's description)
        return
    try:
        cpuinfo = CPUINFO.read_text()
    except OSError:
        cpuinfo = ""
    if not bf16_units(cpuinfo):
        model = cpu_fields(cpuinfo)["model"] or "this CPU"
        raise RecipeError(
            f"rollout.dtype: bfloat16 needs a CPU with bf16 matrix units ({' or '.join(BF16_UNITS)} in "
            f"/proc/cpuinfo); {model} has neither: set rollout.dtype: float32 (or auto, which picks float32 here)"
        )


def rollout_dtype(setting: str, model: torch.nn.Module) -> torch.dtype:
    """The dtype the hf engine samples in for `rollout.dtype` = `setting` on `model` (module docstring)."""
    import torch

    from adaptercl.rollout.packed_weights import onednn_available
    from adaptercl.system import bf16_matmul_available

    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    param = next(model.parameters())
    fits = param.device.type == "cpu" and param.dtype == torch.float32
    return torch.bfloat16 if fits and bf16_matmul_available() and onednn_available(torch.bfloat16) else torch.float32


def cpu_paths(rollout: torch.dtype | None, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """What this process computes with on the CPU, for the run's record: MKL's branch (`cpu_kernels.decision`), the
    packed-weight path per dtype ("on", or why not), for a `model` with float32 CPU layers whether the packs pay on
    this CPU for the decode and for whole sequences (`packed_choice.decision`, measured once per CPU), what the
    training stage's frozen-base products and the float32 decode run on, and the rollouts' dtype (None: not the hf
    engine)."""
    import torch

    from adaptercl.rollout import packed_choice
    from adaptercl.rollout.packed_weights import onednn_available, onednn_refusal, packable, packed_linears
    from adaptercl.system import cpu_kernels

    def packed(dtype: torch.dtype) -> str:
        if not torch.backends.mkldnn.enabled:
            return "off: torch.backends.mkldnn.enabled is False"
        return "on" if onednn_available(dtype) else f"off: {onednn_refusal(dtype)}"

    float32 = packed(torch.float32)
    cpu_layers = model is not None and any(packable(module) for module in model.modules())
    measured = float32 == "on" and cpu_layers
    chosen = {use: packed_choice.decision(use, packed_linears) for use in packed_choice.USES} if measured else {}

    def products(use: str) -> str:
        if use not in chosen:
            return "F.linear (MKL)" if float32 != "on" else "no float32 CPU layer"
        return "oneDNN, packed" if chosen[use]["packed"] else "F.linear (MKL): the packs do not pay on this CPU"

    return {
        "mkl": cpu_kernels.decision(),
        "packed_weights": {"float32": float32, "bfloat16": packed(torch.bfloat16)},
        "packed_choice": chosen,
        "training_base_products": products("sequences"),
        "decode_products": products("decode"),
        "rollout_dtype": None if rollout is None else str(rollout).removeprefix("torch."),
    }
