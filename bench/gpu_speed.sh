#!/usr/bin/env bash
# Issue 12's GPU figures in one call on one lent H100/H200; raw output under $OUT (planned ~7 min on an H200,
# every step capped by its own timeout and by a total budget of $BUDGET_S seconds, default 510):
#
#   OUT=gpu_out bash bench/gpu_speed.sh     # device call: carry [".whl"] (bash bench/fetch_gpu_wheels.sh first)
#   GPU_SPEED_CPU_SMOKE=1 OUT=/tmp/smoke bash bench/gpu_speed.sh   # every step at a tiny shape on the CPU (the flow)
#
# 1. the ratio first (issue 12: trainer vs a compiled nanoGPT-style loop, same call, same GPU), at
#    configs/1.3b.json's shape (24 x 2048, seq 2048, micro-batch 4, global batch 32, bf16, dropout 0.1):
#    a. bench/bench_peer_loop.py --compile                       -> peer_compiled.{json,log}
#    b. pretrain_gpt.py through DeepSpeed, 12 iterations, no recompute, synthetic data, only if DeepSpeed
#       imports after sourcing bench/gpu_env.sh (when present)   -> trainer_1.3b.log, trainer_metrics.jsonl
#    c. bench/bench_peer_loop.py eager                           -> peer_eager.{json,log}
# 2. bench/bench_layer.py: one layer of configs/200b.json as one GPU sees it at tp 8 (hidden 14400, 12 heads,
#    ffn slice 7200, seq 2048; tp all-reduces excluded), none/selective/full, micro-batch 2 (the config's),
#    then 1 and 4                                                -> layer_200b_tp8_mbs{2,1,4}.{json,log}
#    (the .json files are the planner's calibration files)
# 3. bench/bench_single_rank.py at 1.3B bf16 with --recompute none / selective / full: tokens/s, TFLOPs and
#    the peak GPU memory of a training step                      -> single_rank_1.3b_{none,selective,full}.*
# 4. the planner with the calibration (arithmetic), and gptpar/estimate/memory.py's estimates for the step-3 runs
#                                                                -> plan_200b_calibrated.log, memory_estimates.log
# summary.json / summary.txt: the figures above in one place (bench/gpu_speed_summary.py); everything else is
# packed into gpu_speed_raw.tgz at the end (the device call returns at most 8 files).
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-510}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)

if [ -f bench/gpu_env.sh ]; then
  # shellcheck disable=SC1091
  source bench/gpu_env.sh          # the lead's: installs the carried DeepSpeed wheels, sets PYTHONPATH
fi

if [ "${GPU_SPEED_CPU_SMOKE:-0}" = 1 ]; then
  export DS_ACCELERATOR=cpu
  DEV="--device cpu"
  PEER="$DEV --tiny"
  LAYER="$DEV --tiny"
  LAYER_MBS=(2 1)
  SINGLE="$DEV --tiny --no-hf --bf16-shapes ''"
  TRAINER_CONFIG=configs/1.3b.json
  TRAINER_SHAPE=(--set model.num_layers=2 --set model.hidden_size=64 --set model.num_attention_heads=2
                 --set model.seq_length=32 --set model.max_position_embeddings=32 --set model.vocab_size=500
                 --set training.micro_batch_size=2 --set training.global_batch_size=4 --set training.train_iters=3
                 --set training.compile=false)   # 1.3b.json compiles; not worth a CPU minute here
  PLAN_CONFIG=configs/200b.json
else
  DEV="--device cuda"
  PEER="$DEV --config configs/1.3b.json --global-batch-size 32 --iters 10 --warmup 3"
  LAYER="$DEV --config configs/200b.json --iters 20 --warmup 3"
  LAYER_MBS=(2 1 4)
  SINGLE="$DEV --dtype bf16 --config configs/1.3b.json --rounds 8 --warmup 2"
  TRAINER_CONFIG=configs/1.3b.json
  TRAINER_SHAPE=(--set training.global_batch_size=32 --set training.train_iters=12)
  PLAN_CONFIG=configs/200b.json
fi

# step NAME TIMEOUT CMD...: run CMD under min(TIMEOUT, budget left), output into $OUT/NAME.log, keep going.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, the ${BUDGET_S}s budget is spent" | tee -a "$OUT/skipped.txt"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, $(( $(date +%s) - START ))s in)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc $rc: $(grep -v '^{' "$OUT/$name.log" | tail -1 | cut -c1-200)"
  [ "$rc" -ne 0 ] && echo "$name rc $rc" >>"$OUT/failed.txt"
  return 0
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, '|',
          torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  echo "commit $(git rev-parse --short HEAD 2>/dev/null) | $(date -u '+%Y-%m-%d %H:%M UTC')"
} 2>&1 | tee "$OUT/machine.txt"

echo "== 1. the ratio: trainer vs the compiled peer loop"
step peer_compiled 300 $PY bench/bench_peer_loop.py $PEER --compile --json "$OUT/peer_compiled.json"
if $PY -c "import deepspeed" >/dev/null 2>&1; then
  LAUNCH=($PY pretrain_gpt.py)     # one rank needs no launcher; the deepspeed launcher when it is on PATH
  command -v deepspeed >/dev/null 2>&1 && LAUNCH=(deepspeed --num_gpus 1 pretrain_gpt.py)
  step trainer_1.3b 240 "${LAUNCH[@]}" --config "$TRAINER_CONFIG" "${TRAINER_SHAPE[@]}" \
      --set training.train_samples=null --set training.lr_warmup_samples=0 --set training.lr_decay_samples=null \
      --set training.activation_checkpointing=none --set training.eval_interval=null \
      --set checkpoint.save=null --set checkpoint.load=null --set checkpoint.save_interval=null \
      --set checkpoint.keep_last=null --set logging.log_interval=1 --set logging.tensorboard_dir=null \
      --set logging.metrics_file="$OUT/trainer_metrics.jsonl"
else
  echo "   DeepSpeed does not import: the trainer step is skipped" | tee -a "$OUT/skipped.txt"
fi
step peer_eager 150 $PY bench/bench_peer_loop.py $PEER --json "$OUT/peer_eager.json"

echo "== 2. one 200B layer at tp 8 (all-reduces excluded), none/selective/full"
for mbs in "${LAYER_MBS[@]}"; do
  step "layer_200b_tp8_mbs$mbs" 120 $PY bench/bench_layer.py $LAYER --micro-batch-size "$mbs" \
      --json "$OUT/layer_200b_tp8_mbs$mbs.json"
done

echo "== 3. gptpar single rank at 1.3B bf16 per recompute mode (tokens/s, TFLOPs, peak memory)"
for mode in none selective full; do
  step "single_rank_1.3b_$mode" 150 bash -c "$PY bench/bench_single_rank.py $SINGLE --recompute $mode \
      --json $OUT/single_rank_1.3b_$mode.json"
done

echo "== 4. the planner with the calibration; memory estimates"
CAL=$OUT/layer_200b_tp8_mbs2.json
if [ -f "$CAL" ]; then
  step plan_200b_calibrated 60 $PY tools/plan_topology.py --config "$PLAN_CONFIG" --nodes 40 --calibration "$CAL" --measured tests/data/seed_runs.json
fi
step memory_estimates 60 $PY bench/gpu_speed_summary.py --memory-estimates configs/1.3b.json
step summary 60 $PY bench/gpu_speed_summary.py --out "$OUT"
cat "$OUT/summary.log" 2>/dev/null
echo "done in $(( $(date +%s) - START ))s; failed steps: $(cat "$OUT/failed.txt" 2>/dev/null | tr '\n' ' ')"
# The device call brings back at most 8 files from $OUT: keep the summaries, pack the raw logs and JSON.
( cd "$OUT" && ls | grep -v -x -e 'summary.json' -e 'summary.txt' -e 'gpu_speed_raw.tgz' \
    | tar czf gpu_speed_raw.tgz --remove-files -T - )
