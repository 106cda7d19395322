"""What the working-day target asks of the figures the wall-time plan cites (issue 26: the flagship planned at <= 5 h
on a 24 GB card, with the same update).

`adaptercl recipe plan` builds each 24 GB recipe's wall time from measured and cited figures (`plan.wall_time`). Its
largest term, vLLM's decode of NF4 + LoRA on the card, is the product of three cited figures that nobody has measured
together (a bf16 7B sweep on an RTX 4090, vLLM's LoRA / no-LoRA ratio, its bitsandbytes 4-bit / bf16 ratio), and no
lent GPU has vLLM. This script asks the plan, for every 24 GB recipe on an RTX 4090, what those figures would have to
be for 5 h:

- as planned: `recipe plan`'s estimate (every response at the cap);
- vLLM at bf16 speed: the LoRA and 4-bit ratios set to 1, so every vLLM generate call runs at the cited bf16 sweep's
  rate, the fastest decode the cited figures allow (NF4 + LoRA is not expected to beat bf16 without a LoRA);
- the vLLM speed-up over the cited NF4 + LoRA rate that brings the plan to 5 h (every vLLM call that much faster,
  found by bisection), with the model's training step and with the training step at the 24 GB rehearsal's measured /
  model ratio (`plan.rehearsal_check.TIME_RATIO`, measured on an H200; that it carries to a 4090 is an assumption);
- vLLM free: every generate call at 0 s, what is left (training, the diagnostics' forwards, parameter drift).

    python benchmarks/perf/plan_bounds.py          # writes results/plan_bounds.md

Nothing runs on a GPU and nothing is downloaded; tests/benchmarks/test_plan_bounds.py regenerates the committed
markdown, so a change to the plan that moves a figure fails until it is rerun.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import RESULTS_DIR  # noqa: E402
from provenance import markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# The 24 GB recipes, the flagship first, then the flagship on the smaller model its header offers (one override)
RECIPES = ("hybrid", "grpo", "sdpo", "srpo", "sdft", "hybrid model.name=Qwen/Qwen2.5-3B-Instruct")
TARGET_H = 5.0
CARD = "rtx4090"
PHASES = ("training", "rollouts", "evaluation", "diagnostics")
FREE = 1e9  # a speed-up at which every vLLM call takes no time


@functools.cache
def recipe_of(name: str):
    """`recipes/<name>.yaml`, then its overrides if `name` has any after a space (read once: the bisection asks
    for the same recipe's plan many times)."""
    from adaptercl.recipe import load_recipe

    file, *overrides = name.split()
    return load_recipe(REPO / "recipes" / f"{file}.yaml", overrides)


def bf16_speedup() -> float:
    """The speed-up over the cited NF4 + LoRA rate that is the cited bf16 sweep itself (both ratios 1)."""
    from adaptercl.plan import wall_time

    return 1 / (wall_time.VLLM_LORA_RATIO * wall_time.VLLM_BNB_RATIO)


def hours(name: str, vllm_speedup: float = 1.0, train_ratio: float = 1.0) -> dict[str, float]:
    """Each phase's hours of `recipe_of(name)` on the card, every vLLM generate call `vllm_speedup` times the cited
    NF4 + LoRA rate, the training step `train_ratio` times the model's."""
    from adaptercl.plan import wall_time
    from adaptercl.plan.memory import plan_recipe

    with mock.patch.object(wall_time, "VLLM_BNB_RATIO", wall_time.VLLM_BNB_RATIO * vllm_speedup):
        wall = plan_recipe(recipe_of(name), card=CARD).wall_time
    phases = {phase: wall.phase_s(phase) / 3600 for phase in PHASES}
    phases["training"] *= train_ratio
    return phases


def speedup_for(name: str, target_h: float, train_ratio: float = 1.0) -> float | None:
    """The vLLM speed-up over the cited rate at which the plan is `target_h`; None where even free vLLM calls leave
    more (the total falls monotonically with the speed-up: bisection on its logarithm, to 0.1 %)."""

    def total(s: float) -> float:
        return sum(hours(name, s, train_ratio).values())

    if total(1.0) <= target_h:
        return 1.0
    if total(FREE) > target_h:
        return None
    low, high = 1.0, 2.0
    while total(high) > target_h:
        low, high = high, high * 2
    while high / low > 1.001:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if total(mid) > target_h else (low, mid)
    return high


def row(name: str, train_ratio: float) -> list[str]:
    bf16 = bf16_speedup()
    planned, at_bf16 = hours(name), hours(name, bf16)
    needed = [speedup_for(name, TARGET_H), speedup_for(name, TARGET_H, train_ratio)]
    return [
        " ".join([f"{name.split()[0]}.yaml", *name.split()[1:]]),
        f"{sum(planned.values()):.2f} (" + " + ".join(f"{planned[p]:.2f}" for p in PHASES) + ")",
        f"{sum(at_bf16.values()):.2f} (rollouts {at_bf16['rollouts']:.2f})",
        *["none" if s is None else f"{s:.2f}x ({s / bf16:.2f}x bf16)" for s in needed],
        f"{sum(hours(name, FREE).values()):.2f}",
    ]


def markdown() -> str:
    from adaptercl.plan import wall_time
    from adaptercl.plan.rehearsal_check import TIME_RATIO

    bf16 = bf16_speedup()
    train_ratio = TIME_RATIO["train_step"]
    table = markdown_table(
        [
            "recipe",
            "as planned h (training + rollouts + evaluation + diagnostics)",
            f"vLLM at bf16 speed ({bf16:.2f}x) h",
            f"vLLM speed-up for {TARGET_H:g} h",
            f"the same, training step x {train_ratio:.2f}",
            "vLLM free h",
        ],
        [row(name, train_ratio) for name in RECIPES],
    )
    return f"""# What {TARGET_H:g} h asks of the plan's figures (issue 26)

Made by `python benchmarks/perf/plan_bounds.py` (the wall-time plan of `adaptercl recipe plan`, nothing measured
here): each 24 GB recipe on an {wall_time.CARDS[CARD].name}, every response at the cap. Speed-ups are over the cited
vLLM NF4 + LoRA rate (the bf16 sweep x LoRA {wall_time.VLLM_LORA_RATIO:.3f} x bitsandbytes 4-bit \
{wall_time.VLLM_BNB_RATIO:.3f}), applied to every vLLM generate call (rollouts, evaluation, the diagnostics'
sampling); "x bf16" divides by the speed-up that is the bf16 sweep itself ({bf16:.2f}x), so above 1 asks NF4 + LoRA
to decode faster than the cited bf16 base without a LoRA. The last speed-up column sets the training step at the
24 GB rehearsal's measured / model ratio ({train_ratio:.2f}, an H200, `adaptercl/plan/rehearsal_check.py`). "none":
even vLLM calls of 0 s leave more than {TARGET_H:g} h. Interpretation: benchmarks/perf/README.md, "plan_bounds".

{table}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "plan_bounds.md")
    args = parser.parse_args(argv)
    args.out.write_text(markdown())
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
