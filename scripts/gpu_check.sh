#!/usr/bin/env bash
# GPU check, sized to finish in under 5 minutes on one GPU: NCCL init and a collective, then a bf16
# training run of gpt2-124m printing tokens/s, MFU and peak CUDA memory. Run from the repo root on a
# machine whose python3 already has a CUDA build of torch:  bash scripts/gpu_check.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-40}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "torch $($PY -c 'import torch; print(torch.__version__)'), $NGPU GPU(s)"

echo "== NCCL init and all-reduce on $NGPU rank(s)"
$PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" scripts/nccl_check.py

OUT=$(mktemp -d)
echo "== bf16 gpt2-124m, $STEPS steps, compiled, on $NGPU GPU(s) (dp=$NGPU)"
$PY -m trainmesh.cli train --nproc "$NGPU" --dp "$NGPU" --model gpt2-124m --precision bf16 --reduce-dtype bf16 \
    --device cuda --compile --steps "$STEPS" --global-batch $((16 * NGPU)) --warmup-steps 5 --lr 6e-4 \
    --min-lr 6e-5 --eval-batches 1 --out "$OUT" --no-progress
$PY - "$OUT" <<'PY'
import json, sys
s = json.load(open(f"{sys.argv[1]}/summary.json"))
peak = max(s["peak_device_bytes"]) / 2**30
mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a (unknown GPU peak; pass --peak-tflops)"
print(f"tokens/s {s['tokens_per_s']:,.0f} | MFU {mfu} | peak CUDA memory {peak:.2f} GiB/rank | "
      f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
PY
