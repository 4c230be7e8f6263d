#!/usr/bin/env bash
# On a machine with a CUDA GPU: every CUDA-only test (tests/test_cuda.py); a short GPU benchmark (weight precisions x
# a decode step, KV offload 0 / 0.5 / 1) printing one summary table; then issue 31's K = 1 and 8 sessions on one
# bloombee-tiny server computing on the GPU (load_bench, batching on and off). The first two took under 8 minutes on
# an H200; load_bench takes ~2 minutes on this project's CPU machine and has not run on a GPU yet.
# PYTHON names the interpreter (default python3); with OUT set, the benchmarks' JSON is written there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.version.cuda)"
"$python" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py
"$python" -m benchmarks.gpu_bench ${OUT:+--out "$OUT"}
"$python" -m benchmarks.load_bench --servers 1 --ks 1 8 --server-flags "--device cuda --quant-type none" \
    --output "${OUT:-benchmarks/results/gpu}/load_cuda.json"
