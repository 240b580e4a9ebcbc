#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md in one go, for a single lent CUDA GPU (an H100/H200 here, whose image
# has torch and transformers but no DeepSpeed: nothing below needs DeepSpeed).
#
#   OUT=gpu_out bash bench/gpu_run.sh        # ~5 min on an H200; logs and JSON under $OUT
#
# 1. correctness on the GPU: gptpar's logits equal Hugging Face's on the same GPU, its gradients the CPU
#    model's, and bf16 autocast / torch.compile'd layers give the fp32 loss (tests/test_model.py -k cuda;
#    ALiBi through SDPA's CUDA kernels: tests/test_bloom.py -k cuda);
# 2. the single-rank benchmark at tiny size (smoke);
# 3. ~1.3B (configs/1.3b.json: 24 x 2048, seq 2048, micro-batch 4), bf16 autocast, eager, against Hugging
#    Face GPT2LMHeadModel of the same shape, with a kernel-time profile of one step of each;
# 4. the same with gptpar's transformer layers through torch.compile.
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
          'transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== 1. correctness on the GPU"
$PY -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_bloom.py -k cuda 2>&1 | tail -3

echo "== 2. smoke"
$PY bench/bench_single_rank.py --device cuda --tiny --hf 2>&1 | tail -2

echo "== 3. 1.3B bf16 eager vs Hugging Face"
$PY bench/bench_single_rank.py --device cuda --dtype bf16 --config configs/1.3b.json --hf --rounds 10 \
    --profile --json "$OUT/gpu_1.3b_eager.json" >"$OUT/gpu_1.3b_eager.log" 2>&1
grep -A3 "^shape" "$OUT/gpu_1.3b_eager.log" | tail -3; grep "^summary" "$OUT/gpu_1.3b_eager.log" \
    || tail -20 "$OUT/gpu_1.3b_eager.log"

echo "== 4. 1.3B bf16, gptpar's layers compiled"
$PY bench/bench_single_rank.py --device cuda --dtype bf16 --config configs/1.3b.json --compile --rounds 10 \
    --warmup 3 --json "$OUT/gpu_1.3b_compile.json" >"$OUT/gpu_1.3b_compile.log" 2>&1
grep -A2 "^shape" "$OUT/gpu_1.3b_compile.log" | tail -2; grep "^summary" "$OUT/gpu_1.3b_compile.log" \
    || tail -20 "$OUT/gpu_1.3b_compile.log"
