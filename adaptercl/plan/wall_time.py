"""Wall time of a recipe on a 24 GB consumer card, from measured and cited throughputs (`adaptercl recipe plan`).

    wall = estimate_wall_time(recipe, shape, rows=[8, 8, 8], card_gib=24, card="rtx4090")
    print(wall.render())   # the estimate, then every figure it used: measured, cited, derived or assumed
    wall.parts["teacher_lift"].each_s   # one part: its seconds in all, how often it happens, each occurrence

Owns the time model; each figure it uses is a `Figure` with its kind and source (the numbers: `plan/throughputs.py`),
and `render` lists them. No torch.

Training (measured on an H100, `STEPS`: cuda_7b_memory.json, 8 sequences x 1,024 tokens, checkpointing and
1,024-position logit chunks, the step's median at micro-batch 1 and at micro-batch 8). A step of n sequences
(G samples of each of n / G prompts of P tokens, responses of R) in micro-batches of b rows costs

    t(b) = ceil(n / b) x A + (U(b) x P + n x R) x C                              (H100 seconds)

U(b) x P + n x R the positions its forwards compute: each micro-batch runs the prompt of each group it holds once
(`model/prefix_sharing.py`, also under activation checkpointing), so U(b) counts the (micro-batch, group) pairs of the
rows in rollout order (`prefix_runs`; `train/micro_batch_rows.py` takes that order or a cheaper one, so this is an
upper bound). The measurement's 8 sequences ran the plain layout (checkpointing then turned sharing off), 8 x 1,024
positions, so C is a cost per position computed.

A per micro-batch (what does not grow with its rows: the NF4 weights dequantised in each forward, recomputed forward
and backward, kernel launches) and C per token. The two measurements give both exactly (two equations, two
unknowns): t_1 = 8 (A + 1024 C) and t_8 = A + 8 x 1024 C, so C = (t_8 - t_1 / 8) / (7 x 1024), A = t_1 / 8 - 1024 C.
The split into a per-micro-batch and a per-token part is the model's assumption; with two points nothing is left to
check it against. On the card A is scaled by the ratio of memory bandwidths and C by the ratio of dense bf16 tensor
throughputs (`card_factors`, vendor figures in `CARDS`); if A is host-bound (launches) the card changes it less, so
this is an upper bound. Both scale with the model's parameters / 7.6 B (Qwen2.5-7B, the measured shape). Every
response is taken at the cap and every hybrid row as distilled (the measurement distils every row). A method
without a measurement of its own takes another's (`STEP_PROXY`, said in the figures).

Prompts: each stage's domain at its measured mean prompt (`PROMPT_TOKENS`, by the domain's format, from the real
data files with a proxy tokenizer), a domain of another format at an assumed 300 tokens. Evaluation and the drift
probes generate each domain's examples in calls of their own (`measure.evaluate.evaluate_all`,
`measure.drift.response_drift`), so each domain is planned at its own prompt and batch.

Generation. vLLM: a decode step at batch B on an RTX 4090 is tau(B) = tau_0 + tau_1 B, fitted by least squares to a
cited bf16 7B sweep (`VLLM_SWEEP`: output tokens/s at 4 to 48 concurrent requests; no credit beyond 48), divided by
the cited LoRA and bitsandbytes-4-bit throughput ratios (`VLLM_LORA_RATIO`, `VLLM_BNB_RATIO`, assumed independent),
scaled by parameters / 7.25 B (the cited model) and, on another card, by the bandwidth ratio (decoding is
memory-bound). A step's rollouts decode at B = the step's sequences; evaluation and diagnostics in waves of B = what
vLLM's KV cache holds of them (its share of the card, `rollout/vllm_memory.py`), at most 48, the last wave at what is
left (every response at the cap, so a wave ends together). hf engine (transformers generate
on the NF4 training model): a generate call of `rollout.batch_size` rows takes max_new_tokens decode steps of
HF_DECODE_STEP_S (cited, batch 1) plus, above batch 1, bitsandbytes dequantising every weight to bf16 each step
(0.52 + 2 + 2 bytes per parameter read and written, over the card's bandwidth: derived).

Diagnostics: teacher lift (a group sampled, the student and the teacher greedy), stage KL and response drift
(generation, then two forwards per response: each a quarter of GRPO's measured step, which is a forward, a
recomputed forward and a backward of about two forwards) and parameter drift (`DRIFT_REPORT_S`, measured on the
H100, scaled by the token factor). Evaluation: every domain's examples greedy, before the first stage and after each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaptercl.model import GIB, Shape, gib, kv_bytes
from adaptercl.plan import rehearsal_check
from adaptercl.plan.diagnostics_memory import drift_method
from adaptercl.plan.rehearsal import duration
from adaptercl.plan.step_memory import micro_batch_groups, teacher_prompt_tokens
from adaptercl.plan.throughputs import (
    CARDS,
    DEQUANT_BYTES_PER_PARAM,
    DRIFT_REPORT_S,
    DRIFT_SOURCE,
    H100,
    HF_DECODE_SOURCE,
    HF_DECODE_STEP_S,
    MEAN_PROMPT_TOKENS,
    MEASURED_SEQUENCES,
    MEASURED_TOKENS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_SOURCE,
    REFERENCE_PARAMS_B,
    STEP_PROXY,
    STEPS,
    STEPS_SOURCE,
    VLLM_BNB_RATIO,
    VLLM_BNB_SOURCE,
    VLLM_LORA_RATIO,
    VLLM_LORA_SOURCE,
    VLLM_SWEEP,
    VLLM_SWEEP_PARAMS_B,
    VLLM_SWEEP_SOURCE,
    Card,
    Figure,
)
from adaptercl.recipe import ENGINES, METHODS, RecipeConfig, StageConfig
from adaptercl.rollout import vllm_need_terms, vllm_utilization


@dataclass
class Part:
    """One part of a run's time: `seconds` in all, over `count` occurrences (steps, stages, calls)."""

    seconds: float = 0.0
    count: int = 0

    def add(self, seconds: float, times: int = 1) -> None:
        self.seconds += seconds * times
        self.count += times

    @property
    def each_s(self) -> float:
        return self.seconds / self.count if self.count else 0.0


# The parts of a run's time, and the phase of the summary each belongs to.
PARTS = {
    "train_step": "training",
    "rollout_step": "rollouts",
    "evaluation": "evaluation",
    "teacher_lift": "diagnostics",
    "stage_kl": "diagnostics",
    "response_drift": "diagnostics",
    "parameter_drift": "diagnostics",
}


@dataclass
class WallTime:
    card: str
    parts: dict[str, Part]
    figures: list[Figure] = field(default_factory=list)

    def phase_s(self, phase: str) -> float:
        return sum(part.seconds for name, part in self.parts.items() if PARTS[name] == phase)

    @property
    def total_s(self) -> float:
        return sum(part.seconds for part in self.parts.values())

    def render(self) -> str:
        phases = " + ".join(f"{phase} {duration(self.phase_s(phase))}" for phase in dict.fromkeys(PARTS.values()))
        head = (
            f"wall time on an {self.card}-class card (every response at the cap): ~{duration(self.total_s)} = "
            f"{phases}; another machine (a CPU): `adaptercl recipe rehearse` measures it there, then `recipe plan "
            "--rehearsal` gives its wall time"
        )
        rows = [f"  {f.kind:<8} {f.what}: {f.value} ({f.source})" for f in self.figures]
        return "\n".join([head, "time figures (adaptercl/plan/wall_time.py):", *rows])


def card_factors(card: Card) -> tuple[float, float]:
    """(per micro-batch, per token) slowdown of `card` against the measured H100: the bandwidth and the dense bf16
    tensor throughput ratios."""
    return H100.bandwidth_gbs / card.bandwidth_gbs, H100.bf16_tflops / card.bf16_tflops


def measured_as(method: str) -> str:
    """The method whose measured step `method` is planned with: its own, else `STEP_PROXY`'s, else sdpo's."""
    return method if method in STEPS else STEP_PROXY.get(method, "sdpo")


def step_constants(method: str) -> tuple[float, float]:
    """(A s per micro-batch, C s per token) on the H100, solved from the method's two measured steps."""
    t1, t8 = STEPS[measured_as(method)]
    per_token = (t8 - t1 / MEASURED_SEQUENCES) / ((MEASURED_SEQUENCES - 1) * MEASURED_TOKENS)
    return t1 / MEASURED_SEQUENCES - MEASURED_TOKENS * per_token, per_token


def prefix_runs(sequences: int, rows: int, group: int) -> int:
    """U(b): the (micro-batch, group) pairs of a step's `sequences` in rollout order (groups of `group` side by side)
    cut into micro-batches of `rows`: how many prompts its shared-prefix forwards compute."""
    return sum(micro_batch_groups(sequences, rows, group))


def step_s(stage: StageConfig, sequences: int, rows: int, prompt: float, per_mb: float = 1.0,
           per_token: float = 1.0) -> float:  # fmt: skip
    """t(b) of one optimisation pass over `sequences` of the stage in micro-batches of `rows`, prompts of `prompt`
    tokens and responses at the cap: ceil(n / b) A + (U(b) P + n R) C, on the H100 (the measured card) unless the
    card's factors `per_mb`, `per_token` are given; at the measured shape (7.6 B parameters)."""
    a, c = step_constants(stage.method)
    group, response = stage.rollout.group_size, stage.rollout.max_new_tokens
    tokens = prefix_runs(sequences, rows, group) * prompt + sequences * response
    return math.ceil(sequences / rows) * a * per_mb + tokens * c * per_token


def vllm_decode_step_s(batch: int) -> float:
    """tau(B) of the cited bf16 sweep: least squares of B / (tokens/s) on B."""
    xs, ys = [b for b, _ in VLLM_SWEEP], [b / tps for b, tps in VLLM_SWEEP]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx + slope * batch


class Timer:
    """The time model of one recipe on one card (see the module docstring)."""

    def __init__(
        self, recipe: RecipeConfig, shape: Shape, card_gib: float, card: Card, prompt_tokens: float | None = None
    ):
        self.recipe, self.shape, self.card, self.prompt_tokens = recipe, shape, card, prompt_tokens
        self.params_b = (shape.linear_params() + shape.embedding_params()) / 1e9
        self.per_mb, self.per_token = card_factors(card)
        rollout = recipe.stages[0].rollout
        self.engine = "hf" if ENGINES[rollout.engine].home is None else "vllm"
        if self.engine == "vllm":  # the tokens vLLM's KV cache holds at once: its share less the rest of its needs
            needs = [vllm_need_terms(shape, recipe, s, 0) for s in recipe.stages]
            fixed = max(gib({k: v for k, v in need.items() if k != "kv_cache"}) for need in needs)
            kv = (vllm_utilization(shape, recipe, card_gib) * card_gib - fixed) * GIB
            self.kv_tokens = max(0.0, kv) / kv_bytes(shape, 1)

    def prompt(self, domain: str) -> float:
        """Mean prompt tokens of `domain`: the timer's `prompt_tokens` if given, else measured for its format
        (`PROMPT_TOKENS`), else assumed."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return PROMPT_TOKENS.get(self.recipe.domain(domain).format or "", (MEAN_PROMPT_TOKENS,))[0]

    def train_step_s(self, stage: StageConfig, rows: int) -> float:
        n = stage.optim.prompts_per_step * stage.rollout.group_size
        one = step_s(stage, n, rows, self.prompt(stage.domain), self.per_mb, self.per_token)
        return one * self.params_b / REFERENCE_PARAMS_B * stage.grpo.iterations

    def forward_s(self, rows: int, tokens: int) -> float:
        """One no-grad forward of `rows` sequences of `tokens`: a quarter of GRPO's step (see the docstring)."""
        per_mb, per_token = step_constants("grpo")
        one = (per_mb * self.per_mb + rows * tokens * per_token * self.per_token) / 4
        return one * self.params_b / REFERENCE_PARAMS_B

    def generate_s(self, sequences: int, prompt: int, new_tokens: int, batch: int | None = None) -> float:
        """`sequences` responses of up to `new_tokens` to prompts of `prompt` tokens; `batch`: decoded together
        (default: as many as the engine holds)."""
        if sequences == 0:
            return 0.0
        if self.engine == "hf":
            size = self.recipe.stages[0].rollout.batch_size
            calls, rows = math.ceil(sequences / size), min(size, sequences)
            dequant = self.shape.linear_params() * DEQUANT_BYTES_PER_PARAM / (self.card.bandwidth_gbs * 1e9)
            return calls * new_tokens * (HF_DECODE_STEP_S + (dequant if rows > 1 else 0.0))
        fits = max(1, int(self.kv_tokens // (prompt + new_tokens)))  # what vLLM's KV cache holds at once
        together = min(sequences, fits, batch or sequences, VLLM_SWEEP[-1][0])  # no credit beyond the sweep
        scale = CARDS["rtx4090"].bandwidth_gbs / self.card.bandwidth_gbs
        scale *= self.params_b / VLLM_SWEEP_PARAMS_B / (VLLM_LORA_RATIO * VLLM_BNB_RATIO)
        waves, rest = divmod(sequences, together)  # full waves, then the rest decoded together
        steps = waves * vllm_decode_step_s(together) + (vllm_decode_step_s(rest) if rest else 0.0)
        return new_tokens * steps * scale

    def drift_s(self) -> tuple[float, float]:
        """(per report, once per run) of parameter drift on the card."""
        report, once = DRIFT_REPORT_S[drift_method(self.recipe, self.shape)]
        scale = self.per_token * self.params_b / REFERENCE_PARAMS_B
        return report * scale, once * scale


def estimate_wall_time(
    recipe: RecipeConfig,
    shape: Shape,
    rows: list[int],
    card_gib: float = 24.0,
    card: str | Card = "rtx4090",
    prompt_tokens: float | None = None,
) -> WallTime:
    """Training, rollout, evaluation and diagnostics seconds of the whole recipe on `card` (a `CARDS` key, or a
    `Card`: `H100`, `H200` for a measured run); `rows`: each stage's micro-batch (the plan's); `prompt_tokens`: every
    domain's prompt at this length instead of its format's measured mean (a run whose prompts are known, such as the
    24 GB rehearsal's)."""
    timer = Timer(recipe, shape, card_gib, CARDS[card] if isinstance(card, str) else card, prompt_tokens)
    cfg, eval_tokens = recipe.eval, recipe.eval_max_new_tokens
    parts: dict[str, Part] = {name: Part() for name in PARTS}
    drift_reports = 0
    for stage, micro in zip(recipe.stages, rows):
        steps, r = stage.optim.steps, stage.rollout
        n = stage.optim.prompts_per_step * r.group_size
        parts["train_step"].add(timer.train_step_s(stage, micro), steps)
        prompt = timer.prompt(stage.domain)
        parts["rollout_step"].add(timer.generate_s(n, prompt, r.max_new_tokens, batch=n), steps)
        if METHODS[stage.method].needs_teacher and cfg.teacher_lift_prompts:
            lift, context = cfg.teacher_lift_prompts, teacher_prompt_tokens(stage, round(prompt))
            seconds = timer.generate_s(lift * r.group_size, prompt, r.max_new_tokens)  # a group sampled
            seconds += timer.generate_s(lift, prompt, eval_tokens)  # the student, greedy
            seconds += timer.generate_s(lift * r.group_size, context, eval_tokens)  # the teacher with its context
            parts["teacher_lift"].add(seconds)
        if cfg.stage_kl_prompts:
            batches = math.ceil(cfg.stage_kl_prompts / 4)  # measure.policy_divergence.ROWS_PER_FORWARD a forward
            seconds = timer.generate_s(cfg.stage_kl_prompts, prompt, r.max_new_tokens)
            parts["stage_kl"].add(seconds + 2 * batches * timer.forward_s(4, prompt + r.max_new_tokens))
        every = stage.monitor.drift_every
        drift_reports += int(cfg.parameter_drift) + (steps // every if every else 0)
    domains = [timer.prompt(d.name) for d in recipe.domains]  # each domain generated in its own calls
    if cfg.drift_probes:  # after each stage: every domain's probes, then 2 forwards a batch of 4 a domain
        batches = math.ceil(cfg.drift_probes / 4)
        per_stage = sum(
            timer.generate_s(cfg.drift_probes, p, eval_tokens) + 2 * batches * timer.forward_s(4, p + eval_tokens)
            for p in domains
        )
        parts["response_drift"].add(per_stage, len(recipe.stages))
    per_report, once = timer.drift_s()
    if drift_reports:
        parts["parameter_drift"].add(per_report, drift_reports)
        parts["parameter_drift"].seconds += once
    evaluation = sum(timer.generate_s(cfg.examples_per_domain, p, eval_tokens) for p in domains)
    parts["evaluation"].add(evaluation, len(recipe.stages) + 1)  # before the first stage and after each
    return WallTime(timer.card.name, parts, figures(recipe, timer, rows))


def figures(recipe: RecipeConfig, timer: Timer, rows: list[int]) -> list[Figure]:
    """The figures `estimate_wall_time` used for this recipe, with their sources."""
    card = timer.card
    f_mb, f_tok = card_factors(card)
    out = []
    for method in dict.fromkeys(s.method for s in recipe.stages):
        proxy = measured_as(method)
        t1, t8 = STEPS[proxy]
        a, c = step_constants(method)
        what = f"H100 step, {method}" if proxy == method else f"H100 step, {method} (not measured: {proxy}'s)"
        value = f"{t1:.2f} s at micro-batch 1, {t8:.2f} s at 8: A {a:.3f} s per micro-batch, C {1e3 * c:.4f} ms/token"
        out.append(Figure(what, value, "measured" if proxy == method else "assumed", STEPS_SOURCE))
    ratios = (
        f"per micro-batch x {f_mb:.2f} (bandwidth {H100.bandwidth_gbs:g} / {card.bandwidth_gbs:g} GB/s), per token "
        f"x {f_tok:.2f} (dense bf16 {H100.bf16_tflops:g} / {card.bf16_tflops:g} TFLOPS)"
    )
    out.append(Figure(f"{card.name} / H100", ratios, "cited", f"{card.source}; {H100.source}"))
    steps = ", ".join(
        f"{s.name} {timer.train_step_s(s, r):.1f} s (micro-batch {r})" for s, r in zip(recipe.stages, rows)
    )
    out.append(Figure("training step on the card", steps, "derived", "ceil(n / b) A + (U(b) P + n R) C, scaled"))
    if timer.engine == "vllm":
        n = recipe.stages[0].optim.prompts_per_step * recipe.stages[0].rollout.group_size
        sweep = "/".join(f"{t:g}" for _, t in VLLM_SWEEP) + " tok/s at " + "/".join(str(b) for b, _ in VLLM_SWEEP)
        tau0, tau1 = vllm_decode_step_s(0), vllm_decode_step_s(1) - vllm_decode_step_s(0)
        step = timer.generate_s(n, timer.prompt(recipe.stages[0].domain), 1, batch=n)
        fit = f"{step:.3f} s at batch {n}: tau(B) = {1e3 * tau0:.1f} + {1e3 * tau1:.2f} B ms (least squares), / both"
        out += [
            Figure("vLLM bf16 7B decode", f"{sweep} concurrent requests", "cited", VLLM_SWEEP_SOURCE),
            Figure("vLLM with a LoRA / without", f"{VLLM_LORA_RATIO:.3f}", "cited", VLLM_LORA_SOURCE),
            Figure("vLLM bitsandbytes 4-bit / bf16", f"{VLLM_BNB_RATIO:.3f}", "cited", VLLM_BNB_SOURCE),
            Figure("vLLM NF4 + LoRA decode step", fit, "derived", "the three figures above"),
        ]
    else:
        dequant = timer.shape.linear_params() * DEQUANT_BYTES_PER_PARAM / (card.bandwidth_gbs * 1e9)
        above = f"+ {dequant:.3f} s ({DEQUANT_BYTES_PER_PARAM:.2f} bytes a parameter / {card.bandwidth_gbs:g} GB/s)"
        out += [
            Figure("hf decode step, NF4 7B, batch 1", f"{HF_DECODE_STEP_S:.3f} s", "cited", HF_DECODE_SOURCE),
            Figure("hf decode step above batch 1", above, "derived", "bitsandbytes dequantises every weight a step"),
        ]
    drift = f"{DRIFT_REPORT_S['lowrank'][0]:g} s lowrank, {DRIFT_REPORT_S['exact'][0]:g} s exact, x {f_tok:.2f}"
    out.append(Figure("parameter drift report on the H100", drift, "measured", DRIFT_SOURCE))
    what = "this model checked on an H200 (transformers engine), measured / model"
    out.append(Figure(what, rehearsal_check.time_line(), "measured", rehearsal_check.SOURCE))
    measured = [d for d in recipe.domains if (d.format or "") in PROMPT_TOKENS]
    others = [d.name for d in recipe.domains if d not in measured]
    if measured:
        value = ", ".join(f"{d.name} {timer.prompt(d.name):.0f}" for d in measured) + " tokens"
        out.append(Figure("mean prompt per domain", value, "measured", PROMPT_TOKENS_SOURCE))
    if others:
        value = f"{MEAN_PROMPT_TOKENS} tokens for {', '.join(others)}"
        out.append(Figure("mean prompt of the other domains", value, "assumed", "no measurement of their format"))
    return out
