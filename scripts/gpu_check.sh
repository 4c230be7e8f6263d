#!/usr/bin/env bash
# On a machine with a CUDA GPU (under 8 minutes on one): every CUDA-only test (tests/test_cuda.py), then a short GPU
# benchmark (weight precisions x a decode step, KV offload 0 / 0.5 / 1) printing one summary table.
# PYTHON names the interpreter (default python3); with OUT set, the benchmark's JSON is written there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.version.cuda)"
"$python" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py
"$python" -m benchmarks.gpu_bench ${OUT:+--out "$OUT"}
