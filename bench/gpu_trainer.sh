#!/usr/bin/env bash
# The trainer's GPU check in one call (bench/gpu_trainer.py: bf16 train / save / resume, recompute, fp16 loss
# scaling, the single-rank bench beside it), for one lent CUDA GPU. About 6-8 minutes on an H100/H200.
#
#   on the CPU machine:  bash bench/fetch_gpu_wheels.sh
#   device call:         run(command="OUT=$OUT bash bench/gpu_trainer.sh", carry=[".whl"], timeout_s=600)
#
# $OUT gets summary.json, the printed summary (gpu_trainer.txt) and every run's log and metrics in one
# archive (gpu_trainer_logs.tgz); checkpoints go to /tmp and are deleted.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/gpu_env.sh
WORK=/tmp/gpu_trainer
rm -rf "$WORK" /tmp/gpu_trainer_ck
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 bench/gpu_trainer.py --out "$WORK" --scratch /tmp/gpu_trainer_ck "$@"
} 2>&1 | tee "$OUT/gpu_trainer.txt"
cp "$WORK/summary.json" "$OUT/" 2>/dev/null
tar czf "$OUT/gpu_trainer_logs.tgz" -C "$WORK" --exclude checkpoints .
