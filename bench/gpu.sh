#!/usr/bin/env bash
# gptpar's one GPU entry point: every GPU figure and check of docs/benchmarks.md, for one lent CUDA GPU.
#
#   bash bench/gpu.sh prepare               # on a machine with PyPI: wheels -> .whl/, the demo data -> data/demo/
#   OUT=gpu_out bash bench/gpu.sh speed     # on the GPU (the device call carries .whl and data/demo): ~5 min, <= 7.5
#   OUT=gpu_out bash bench/gpu.sh checks    # on the GPU: correctness (tests -k cuda), bf16 save/resume, fp16 scaling
#   OUT=gpu_out bash bench/gpu.sh calibrate # on the GPU: the planner's per-layer calibration files (~7 min)
#   GPU_CPU_SMOKE=1 OUT=/tmp/s bash bench/gpu.sh speed    # the same flow at tiny shapes on the CPU (make test-slow)
#   STEPS="rounds summary" ROUNDS_TIMED=4 ... # only those steps, fewer timed iterations (a short lease)
#
# The GPU image has CUDA torch, transformers and sentencepiece but no DeepSpeed, no torchao and no package
# registry: `prepare` downloads their wheels for its Python 3.12 into .whl/ (git-ignored), and every GPU mode
# installs them into /tmp/site first. How this repository's device calls use it: docs/benchmarks.md.
#
# `speed`: at configs/1.3b.json's shape (24 x 2048, seq 2048, micro-batch 4, global batch 32 = 8 micro-batches,
# dropout 0.1, no recompute, compiled) on the demo's real tokens, each step under its own timeout and all under
# BUDGET_S (default 450 s), in this order:
#   rounds        bench/rounds.py: the runs of ROUND_RUNS (default "peer bf16 fp8") start together and share the GPU's
#                 memory, then take it in turns: ROUNDS (3) rounds, each giving every run one turn of ROUNDS_WARMUP (2)
#                 untimed and ROUNDS_TIMED (6) timed iterations, the order rotated each round; all of it within
#                 ROUNDS_TIMEOUT (330 s). The runs:
#                   peer    bench/bench_peer_loop.py --compile --rounds: the nanoGPT-style loop the trainer must beat
#                   bf16    pretrain_gpt.py (bench/pretrain_in_rounds.py), training.compile=true, bf16
#                   fp8     the same with training.precision=fp8 (torchao float8, tensorwise, weight casts cached)
#                   before  bf16 on an earlier tree carried in .before/ (`git archive`): a change's gain, its losses
#                 (three at a time: four 1.3B runs do not fit an H200's memory together)
#   cuda_checks   the CUDA forms of what the speed relies on (tests -k cuda; below)
#   layer_bf16 / layer_fp8  bench/bench_layer.py: one configs/200b.json layer as a tp-8 GPU sees it, compiled,
#                 bf16 and fp8 (weight casts cached, and not), forward + backward        (target: fp8 >= 1.3x bf16)
#   summary       bench/gpu_summary.py: per round each run's seconds per iteration, the ratios (trainer bf16 / peer
#                 target: median >= 1.08, every round >= 1.03; fp8 / bf16 >= 1.20), their median and worst round,
#                 each run's memory peaks over the whole run, the losses, the tree that ran (machine.txt, tree.json), the
#                 call's wall time
# Named in STEPS only (not run by default): peer_profile and trainer_profile, torch.profiler over two iterations of
# the peer's loop and of the bf16 trainer (the top kernels, the device's busy share and idle gaps; TRACE=1 keeps the
# trainer's Chrome trace). STEPS="..." runs only the named steps; a step the budget cannot start is skipped and
# said in skipped.txt. $OUT gets machine.txt, summary.{json,txt} and raw.tgz (every log, metrics file and JSON).
set -u
MODE=${1:-speed}
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-450}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

prepare() {
  # DeepSpeed as a pure wheel (no ops built: the trainer passes a client AdamW) plus what the GPU image lacks,
  # torchao for fp8, and the demo's tokenizer and .bin/.idx (real text for the trainer runs' losses).
  set -e
  local pip=${PIP:-.venv/bin/pip} dl="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
  local plat="--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
  mkdir -p .whl
  DS_BUILD_OPS=0 $pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
  $pip download -q $dl $plat --platform any -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 \
      annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 torchao==0.18.0
  ${PYTHON:-.venv/bin/python} tools/demo.py --prepare-only
  ls -la .whl data/demo
}

install_wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH \
      || echo "gpu.sh: installing .whl/*.whl failed" >&2
  else
    echo "gpu.sh: no .whl/: run 'bash bench/gpu.sh prepare' where PyPI is reachable and carry .whl" >&2
  fi
  export DS_BUILD_OPS=0   # DeepSpeed never JIT-builds an op here
}

START=$(date +%s)
# step NAME TIMEOUT CMD...: CMD under min(TIMEOUT, the budget left), output in $OUT/NAME.log; the next step runs
# whatever this one did.
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS summary " != *" $name "* ]]; then
    return 0
  fi
  run_step "$name" "$limit" "$@"
}

# named_step NAME TIMEOUT CMD...: a step that runs only when STEPS names it.
named_step() {
  [[ " ${STEPS:-} " == *" $1 "* ]] && run_step "$@"
  return 0
}

run_step() {
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

machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, '|',
          torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  $PY -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  # The tree that runs: the copy's .git may be older than its files, so its HEAD alone does not say what ran.
  $PY bench/gpu_summary.py --tree --out "$OUT"
  echo "$(date -u '+%Y-%m-%d %H:%M UTC') | mode $MODE"
}

pack() {
  # The device call brings back at most 8 files: keep the summaries, pack everything else.
  ( cd "$OUT" && ls | grep -v -x -e 'summary.json' -e 'summary.txt' -e 'machine.txt' -e 'raw.tgz' \
      | tar czf raw.tgz --remove-files -T - )
}

speed() {
  local dev trainer peer layer
  local rounds=${ROUNDS:-3} warm=${ROUNDS_WARMUP:-2} timed=${ROUNDS_TIMED:-6}
  export ROUNDS_PRE=2  # the trainer's iterations before its first turn: the compile, the optimizer state's first step
  if [ "${GPU_CPU_SMOKE:-0}" = 1 ]; then
    export DS_ACCELERATOR=cpu
    dev="--device cpu"
    peer="$dev --tiny --iters 2 --warmup 1"
    layer="$dev --tiny --modes none --iters 2 --warmup 1"
    trainer=(--set model.num_layers=2 --set model.hidden_size=64 --set model.num_attention_heads=4
             --set model.seq_length=32 --set model.max_position_embeddings=32 --set training.micro_batch_size=2
             --set training.global_batch_size=4 --set model.vocab_size=4096)
    warm=${ROUNDS_WARMUP:-1} timed=${ROUNDS_TIMED:-2}
  else
    dev="--device cuda"
    peer="$dev --config configs/1.3b.json --global-batch-size 32 --iters 2 --warmup 3"
    layer="$dev --config configs/200b.json --modes none --iters 10 --warmup 3"
    trainer=(--set training.global_batch_size=32)
  fi
  if [ ! -f data/demo/demo_text_document.idx ]; then
    if [ "${GPU_CPU_SMOKE:-0}" = 1 ]; then $PY tools/demo.py --prepare-only >"$OUT/prepare.log" 2>&1
    else echo "gpu.sh: no data/demo: run 'bash bench/gpu.sh prepare' and carry data/demo's .bin, .idx and tokenizer" >&2
    fi
  fi
  # The trainer: one rank, DeepSpeed's launcher, the demo's tokens under 1.3b.json's vocabulary (its ids < 4096
  # fit; the shape stays the peer's), an iteration-based schedule, a log record every iteration.
  local launch=($PY -m deepspeed.launcher.runner --num_gpus 1)
  local args=(--config configs/1.3b.json "${trainer[@]}"
              --set data.synthetic=false --set data.data_path=data/demo/demo_text_document
              --set data.tokenizer_model=data/demo/tokenizer.model --set data.split=1000,0,0
              --set training.train_samples=null --set training.lr_warmup_samples=0 --set training.lr_decay_samples=null
              --set training.lr_warmup_iters=2 --set training.activation_checkpointing=none
              --set training.eval_interval=null --set checkpoint.save=null --set checkpoint.load=null
              --set checkpoint.save_interval=null --set checkpoint.keep_last=null --set logging.log_interval=1
              --set logging.tensorboard_dir=null --set training.compile=true)
  echo "== 1. rounds: ${ROUND_RUNS:-peer bf16 fp8} in turns, $rounds x ($warm untimed + $timed timed iterations)"
  local runs=() port=29501 name iters=$(( ROUNDS_PRE + rounds * (warm + timed) ))
  for name in ${ROUND_RUNS:-peer bf16 fp8}; do
    local in=(--master_port $port "$PWD/bench/pretrain_in_rounds.py" "${args[@]}" --set training.train_iters=$iters
              --set logging.metrics_file="$OUT/rounds/$name.jsonl")
    port=$(( port + 1 ))
    case $name in
      peer) runs+=(--run "peer=$PY bench/bench_peer_loop.py $peer --compile --rounds --json $OUT/rounds/peer.json") ;;
      bf16) runs+=(--run "bf16=$(printf '%q ' "${launch[@]}" "${in[@]}")") ;;
      fp8) runs+=(--run "fp8=$(printf '%q ' "${launch[@]}" "${in[@]}" --set training.precision=fp8)") ;;
      before)
        # the earlier tree's gptpar and pretrain_gpt.py, this tree's turn-taking wrapper
        [ -e .before/data ] || ln -s "$PWD/data" .before/data
        runs+=(--run "before=$(printf '%q ' env -C .before ROUNDS_CODE_ROOT="$PWD/.before" \
                PYTHONPATH="$PWD/.before${PYTHONPATH:+:$PYTHONPATH}" "${launch[@]}" "${in[@]}")") ;;
      *) echo "gpu.sh: ROUND_RUNS: unknown run $name (peer, bf16, fp8, before)" >&2 ;;
    esac
  done
  local limit=${ROUNDS_TIMEOUT:-330}
  step rounds $(( limit + 10 )) $PY bench/rounds.py --out "$OUT" --rounds "$rounds" --warmup "$warm" --timed "$timed" \
      --timeout "$limit" "${runs[@]}"
  echo "== 2. the CUDA checks, one 200B tp-8 layer"
  # The CUDA forms of what the speed relies on: the int32 dropout hash under Triton equals the int64 formula,
  # torchao's float8 GEMMs equal their emulation, the fused fp32 gradient sums (the GEMM's, the embedding
  # lookup's, the side stream's batched adds) equal fp64's or DeepSpeed's, the step's loss and norm are read
  # without waiting for the optimizer step, the NaN/Inf skip is decided without a host read.
  [ "${GPU_CPU_SMOKE:-0}" = 1 ] || step cuda_checks 90 $PY -m pytest -q -p no:cacheprovider -k "cuda" \
      tests/integration/test_compile.py::test_counter_dropout_int32_hash_is_the_int64_hash tests/integration/test_float8.py \
      tests/integration/test_grad_accumulation_fusion.py tests/integration/test_step_syncs.py \
      tests/integration/test_precision.py::test_fused_accumulation_adds_small_gradients_together_at_the_end_of_backward
  step layer_bf16 90 $PY bench/bench_layer.py $layer --compile --dtype bf16 --json "$OUT/layer_bf16.json"
  step layer_fp8 90 $PY bench/bench_layer.py $layer --compile --dtype fp8 --json "$OUT/layer_fp8.json"
  # Where the time goes (named in STEPS only): the peer's loop, and the bf16 trainer over iterations 4-5.
  named_step peer_profile 150 $PY bench/bench_peer_loop.py $peer --compile --iters 1 --warmup 2 --profile 2
  named_step trainer_profile 120 "${launch[@]}" pretrain_gpt.py "${args[@]}" --set training.train_iters=5 \
      --set logging.profile=4-5 ${TRACE:+--set logging.profile_dir=$OUT/trace}
  step summary 60 $PY bench/gpu_summary.py --out "$OUT" --call-start "$START"
  cat "$OUT/summary.txt" 2>/dev/null
}

checks() {
  # Correctness on the GPU (logits against Hugging Face's, gradients against the CPU's, compiled against eager,
  # fp8 against torchao's own Float8Linear), then bench/gpu_trainer.py: bf16 train / save / resume, recompute,
  # fp16 loss scaling against the scale saved in the checkpoint.
  local smoke=()
  [ "${GPU_CPU_SMOKE:-0}" = 1 ] && smoke=(--cpu-smoke) && export DS_ACCELERATOR=cpu
  [ "${GPU_CPU_SMOKE:-0}" = 1 ] || step tests_cuda 200 $PY -m pytest -q -p no:cacheprovider -k cuda \
      tests/integration/test_model.py tests/integration/test_bloom.py tests/integration/test_compile.py tests/integration/test_float8.py
  step trainer_checks 360 $PY bench/gpu_trainer.py --out "$OUT/trainer_checks" --scratch /tmp/gpu_trainer_ck "${smoke[@]}"
  cp "$OUT/trainer_checks/summary.json" "$OUT/summary.json" 2>/dev/null
  grep -h -A2 "passed\|failed" "$OUT/tests_cuda.log" 2>/dev/null | tail -3 | tee "$OUT/summary.txt"
}

calibrate() {
  # The planner's calibration (docs/planning.md): one configs/200b.json layer as a tp-8 GPU sees it per micro-batch
  # and recompute mode (the JSON files are calibration files), gptpar's single rank at 1.3B per recompute mode
  # (tokens/s, TFLOPs, peak memory), and the planner's 200B layout with the calibration.
  local dev=(--device cuda) layer=(--config configs/200b.json --iters 20 --warmup 3) mbs_list=(2 1 4)
  local single=(--dtype bf16 --config configs/1.3b.json --rounds 8 --warmup 2)
  if [ "${GPU_CPU_SMOKE:-0}" = 1 ]; then
    dev=(--device cpu) layer=(--tiny) mbs_list=(2) single=(--tiny --no-hf --bf16-shapes "")
  fi
  for mbs in "${mbs_list[@]}"; do
    step "layer_200b_tp8_mbs$mbs" 120 $PY bench/bench_layer.py "${dev[@]}" "${layer[@]}" --micro-batch-size "$mbs" \
        --json "$OUT/layer_200b_tp8_mbs$mbs.json"
  done
  for mode in none selective full; do
    step "single_rank_1.3b_$mode" 150 $PY bench/bench_single_rank.py "${dev[@]}" "${single[@]}" --recompute $mode \
        --json "$OUT/single_rank_1.3b_$mode.json"
  done
  step plan_200b_calibrated 60 $PY tools/plan_topology.py --config configs/200b.json --nodes 40 \
      --calibration "$OUT/layer_200b_tp8_mbs2.json" --measured tests/data/seed_runs.json
  tail -15 "$OUT/plan_200b_calibrated.log" | tee "$OUT/summary.txt"
}

case "$MODE" in
  prepare) prepare ;;
  speed|checks|calibrate)
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: some steps run in other folders
    [ "${GPU_CPU_SMOKE:-0}" = 1 ] || install_wheels
    machine 2>&1 | tee "$OUT/machine.txt"
    $MODE
    echo "done in $(( $(date +%s) - START ))s; failed steps: $(cat "$OUT/failed.txt" 2>/dev/null | tr '\n' ' ')"
    pack ;;
  *) echo "usage: bash bench/gpu.sh prepare|speed|checks|calibrate (see the header)" >&2; exit 2 ;;
esac
