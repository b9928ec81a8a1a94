#!/usr/bin/env bash
# GPU check, about 10 minutes on one GPU: NCCL init and an all-reduce, then scripts/gpu_check.py (gpt2-124m
# compiled in bf16 with fused SDPA attention and fused AdamW, + CUDA graphs, + FP8 linears; a llama-7b-class
# model at the most layers one GPU holds under ZeRO-3, in bf16 and in FP8; --cases all adds eager, ZeRO-1,
# full recompute and gpt2-1.5b under ZeRO-3), each case with its own time limit: tokens/s, MFU against the
# dense bf16 and FP8 peaks, peak memory, loss, FP8's loss against bf16's and issue #37's goals, appended to
# docs/performance.md with the date, GPU, torch, torchao and triton versions. Run from the repo root with a
# python3 that has a CUDA build of torch and torchao (pip install -e '.[fp8]'); arguments go to gpu_check.py
# (e.g. --steps 30 --cases compiled,graphs --logs DIR):
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

echo "== async checkpoints stage GPU state into reused pinned host buffers"
if $PY -c "import pytest" 2>/dev/null; then $PY -m pytest -q -p no:cacheprovider tests/unit/test_host_buffers.py
else echo "(pytest is not installed here: pip install -e '.[dev]' to run it)"; fi

echo "== NCCL done; training cases"
$PY scripts/gpu_check.py "$@"
