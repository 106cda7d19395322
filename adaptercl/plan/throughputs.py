"""The measured and cited figures the wall-time model (`plan/wall_time.py`) is built from, each with its source: the
cards' spec sheets, the H100 step measurements, vLLM's and transformers' decode rates, the parameter-drift report's
seconds and the shipped domains' prompt lengths. Numbers only; the model that combines them is `wall_time`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["measured", "cited", "derived", "assumed"]


@dataclass(frozen=True)
class Figure:
    """One number of the estimate and where it comes from."""

    what: str
    value: str
    kind: Kind
    source: str


@dataclass(frozen=True)
class Card:
    name: str
    bandwidth_gbs: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor throughput (FP32 accumulate), TFLOPS
    source: str


# Data-center cards a run was measured on (not `--card` choices: the plan is for 24 GB cards); `estimate_wall_time`
# takes them to set a measured run beside the model (benchmarks/perf/rehearsal_vs_plan.py).
H100 = Card(
    "H100 SXM5 80 GB (the measured card, 'NVIDIA H100 80GB HBM3')", 3350.0, 989.4,
    "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ : 3.35 TB/s; BF16 Tensor Core "
    "1,979 TFLOPS with sparsity, 989.4 dense",
)  # fmt: skip
H200 = Card(
    "H200 SXM 141 GB ('NVIDIA H200')", 4800.0, 989.4,
    "NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ : 4.8 TB/s; BF16 Tensor Core 1,979 "
    "TFLOPS with sparsity, 989.4 dense",
)  # fmt: skip
CARDS = {
    "rtx4090": Card(
        "RTX 4090", 1008.0, 165.2,
        "NVIDIA Ada GPU architecture whitepaper, https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
        "nvidia-ada-gpu-architecture.pdf : 1,008 GB/s; peak BF16 tensor TFLOPS with FP32 accumulate 165.2 dense",
    ),
    "rtx3090": Card(
        "RTX 3090", 936.0, 71.0,
        "NVIDIA Ampere GA102 GPU architecture whitepaper, https://www.nvidia.com/content/PDF/"
        "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf : 936 GB/s; peak BF16 tensor TFLOPS with FP32 "
        "accumulate 71 dense",
    ),
}  # fmt: skip

# H100 step medians (s) of 8 sequences x 1,024 tokens at micro-batch 1 and 8 (variants <method>:8:true:auto and
# <method>:1:true:auto of benchmarks/perf/results/cuda_7b_memory.json; tests/plan/test_wall_time.py reads them back)
STEPS = {
    "grpo": (4.061168836000007, 1.3884670644999986),
    "hybrid": (5.841130996000004, 1.9974445160000016),
    "sdpo": (7.61932156200001, 2.6921620525000023),
    "sdft": (6.287257638, 2.5563179379999994),
}
STEPS_SOURCE = "benchmarks/perf/results/cuda_7b_memory.json (NVIDIA H100 80GB HBM3, NF4 Qwen2.5-7B shape)"
MEASURED_SEQUENCES, MEASURED_TOKENS = 8, 1024
# srpo: not measured; sdpo's step (its teacher on every row) is an upper bound, as srpo's teacher forward runs on its
# SDPO-routed rows only. A new method is planned with sdpo's figures until it is measured (said in the figures).
STEP_PROXY = {"srpo": "sdpo"}
REFERENCE_PARAMS_B = 7.6  # Qwen2.5-7B, the measured shape

VLLM_SWEEP = ((4, 210.0), (8, 377.0), (16, 644.0), (32, 975.0), (48, 1190.0))  # (concurrent requests, output tok/s)
VLLM_SWEEP_SOURCE = (
    "Mistral-7B-Instruct-v0.3 bf16, vLLM on one RTX 4090, 256 -> 128 tokens, 300 prompts: "
    "https://mushfiqrahman.dev/benchmarking-mistral-7b-on-rtx-4090-vllm-concurrency-latency-and-capacity-planning/"
)
VLLM_SWEEP_PARAMS_B = 7.25
VLLM_LORA_RATIO = 1787.78 / 2693.62  # 0.664: Llama-2-7b, 1 x A100, one rank-8 LoRA vs none (output tokens/s)
VLLM_LORA_SOURCE = "vLLM benchmark_throughput, Llama-2-7b on an A100: https://github.com/vllm-project/vllm/pull/11267"
VLLM_BNB_RATIO = 45.0 / 71.0  # 0.634: Llama-3.2-1B on an A100, offline LLM: 45 s bf16 vs 71 s bitsandbytes 4-bit
VLLM_BNB_SOURCE = "vLLM 0.6.3, https://github.com/vllm-project/vllm/issues/9535"
HF_DECODE_STEP_S = 1 / 12.2  # transformers generate, Llama-2-7B NF4 (double quant, bf16), batch 1: 12.2 tokens/s
HF_DECODE_SOURCE = "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/696 (the issue names no GPU)"
DEQUANT_BYTES_PER_PARAM = 4.127 / 8 + 2 + 2  # read NF4 + absmax, write bf16, the matmul reads the bf16 weight again
DRIFT_REPORT_S = {"lowrank": (1.8, 2.1), "exact": (132.0, 132.0)}  # H100: per report, once per run (W0's spectra)
DRIFT_SOURCE = "benchmarks/perf/drift_7b_shape.md (H100, Qwen2.5-7B's 196 adapted weights)"
# Mean prompt tokens of a domain by its format, (mean, prompts counted): the shipped recipes' prompts from the real
# data files, chat template applied, measured by benchmarks/perf/padding.py with SmolLM2-135M-Instruct's tokenizer (the
# 7B's own is not available offline: a proxy). A domain of another format is planned at MEAN_PROMPT_TOKENS, assumed.
PROMPT_TOKENS = {"gsm8k": (98.1, 2000), "sciknoweval": (309.6, 1890), "tooluse": (809.1, 64)}
PROMPT_TOKENS_SOURCE = (
    "benchmarks/perf/results/padding.json (SmolLM2-135M-Instruct's tokenizer and chat template as a proxy; every "
    "gsm8k and sciknoweval train prompt, 64 tooluse prompts)"
)
MEAN_PROMPT_TOKENS = 300  # assumed: a domain whose format has no measurement (e.g. the retention probes)
