#!/usr/bin/env bash
# GPU check, about 5 minutes on one GPU: NCCL init and an all-reduce, then scripts/gpu_check.py (bf16
# gpt2-124m eager and compiled with fused SDPA attention and fused AdamW, the same under ZeRO-1 and under full
# recompute, and gpt2-1.5b under ZeRO-3): tokens/s, MFU and peak memory, appended to docs/performance.md with
# the date, GPU and torch version. Run from the repo root with a python3 that has a CUDA build of torch;
# arguments go to gpu_check.py (e.g. --steps 30 --timeout 120 --logs DIR):
#   bash scripts/gpu_check.sh [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "torch $($PY -c 'import torch; print(torch.__version__)'), $NGPU GPU(s)"

echo "== NCCL init and all-reduce on $NGPU rank(s)"
$PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" scripts/nccl_check.py

echo "== NCCL done; training cases"
$PY scripts/gpu_check.py "$@"
