#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, on a machine that already has
# torch (with CUDA) and the engine's Python dependencies; nothing is installed
# unless wheels were put in .whl/ (then they are installed into /tmp/site first,
# e.g. the transformers version requirements.txt pins).
#
#   bash scripts/gpu_check.sh            # tests that skip without CUDA, then the CUDA benchmark
#
# Prints everything; exits non-zero when a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH" || exit 1
fi
python3 - <<'PY'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"CUDA {torch.cuda.is_available()} {torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
PY
status=0
python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/unit/worker/test_engine_decode_graphs.py tests/unit/worker/test_engine_varlen_attention.py \
    -k "gpu or cuda" -rs || status=1
python3 -m benchmarks.cuda_decode_bench || status=1
exit $status
