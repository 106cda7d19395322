"""Which CPU kernels make the quickstart's model fast on this machine: SmolLM2-135M-Instruct's float32 forward and
decode step on torch's default (native) kernels, and the forward under bf16 autocast (what `distill.teacher.autocast:
auto` gives the teacher on a CPU with AMX or AVX512-BF16). Run it twice to compare the kernels, once natively and
once as an AVX2-only CPU computes:

    HF_HUB_OFFLINE=1 python benchmarks/quickstart/isa_speed.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2 HF_HUB_OFFLINE=1 \
        python benchmarks/quickstart/isa_speed.py

Shapes as in the quickstart's training step: a forward of 12 rows x 160 tokens (the student's or the teacher's
micro-batch of responses after their prompts), a decode step of 24 rows (4 prompts x 6 samples) over a 100-token
cache. Prints seconds per call, the mean of 5 forwards / 48 decode steps after one warm-up forward.
"""

from __future__ import annotations

import os
import time

import torch

from adaptercl.model import resolve_model_path
from adaptercl.recipe.grammar import ModelConfig

FORWARD_ROWS, FORWARD_TOKENS, DECODE_ROWS, CACHE_TOKENS = 12, 160, 24, 100


def main() -> None:
    from transformers import AutoModelForCausalLM

    path, _ = resolve_model_path(ModelConfig(name="smollm2-135m-instruct"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (FORWARD_ROWS, FORWARD_TOKENS), generator=gen)

    @torch.no_grad()
    def forward(autocast: bool, calls: int = 5) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids)
            start = time.perf_counter()
            for _ in range(calls):
                model(ids)
        return (time.perf_counter() - start) / calls

    @torch.no_grad()
    def decode(steps: int = 48) -> float:
        prompt = torch.randint(0, model.config.vocab_size, (DECODE_ROWS, CACHE_TOKENS), generator=gen)
        cache = model(prompt, use_cache=True).past_key_values
        token = prompt[:, -1:]
        start = time.perf_counter()
        for _ in range(steps):
            cache = model(token, past_key_values=cache, use_cache=True).past_key_values
        return (time.perf_counter() - start) / steps

    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    print(f"kernels {isa} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")
    print(f"float32 forward {FORWARD_ROWS}x{FORWARD_TOKENS}: {forward(False):.3f} s")
    print(f"bf16 autocast forward {FORWARD_ROWS}x{FORWARD_TOKENS}: {forward(True):.3f} s")
    print(f"float32 decode step, {DECODE_ROWS} rows: {decode():.4f} s")


if __name__ == "__main__":
    main()
