#!/usr/bin/env bash
# Multi-node launch of configs/200b.json (tp 8 x pp 10 x dp 4 = 320 GPUs = 40 nodes of 8 A100s) with
# DeepSpeed's hostfile launcher, which starts GPUS_PER_NODE ranks on every host of the hostfile over pdsh/ssh.
#
#   examples/launch_hostfile.sh HOSTFILE [pretrain_gpt.py options ...]
#   examples/launch_hostfile.sh --dry-run HOSTFILE [...]   (or DRY_RUN=1): print the environment and the
#                                                          launch line, start nothing
#
# HOSTFILE: one line per node, "<hostname> slots=8". Run from the repository root on the first host, with the
# repository and the virtual environment at the same path on every node. Extra options go to pretrain_gpt.py,
# e.g. --set training.train_iters=10 or --set checkpoint.save=/scratch/ck.
# Environment knobs: CONFIG (configs/200b.json), GPUS_PER_NODE (8), MASTER_PORT (6000), PYTHON (python3),
# DEEPSPEED (deepspeed), CUDA_LAUNCH_BLOCKING (1, see below), NCCL_SOCKET_IFNAME / NCCL_IB_HCA (site-specific).
set -euo pipefail

die() { echo "launch_hostfile.sh: $*" >&2; exit 2; }

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
[[ $# -ge 1 ]] || die "usage: $0 [--dry-run] HOSTFILE [pretrain_gpt.py options ...]"
HOSTFILE=$1; shift
CONFIG=${CONFIG:-configs/200b.json}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-6000}
PYTHON=${PYTHON:-python3}
DEEPSPEED=${DEEPSPEED:-deepspeed}
[[ -f $HOSTFILE ]] || die "hostfile $HOSTFILE not found (one line per node: '<hostname> slots=$GPUS_PER_NODE')"
[[ -f $CONFIG ]] || die "config $CONFIG not found (run from the repository root or set CONFIG)"

# The config names the world it expects: nodes x GPUs per node must equal tp x pp x dp.
NNODES=$(grep -cvE '^[[:space:]]*(#|$)' "$HOSTFILE" || true)
read -r TP PP DP < <("$PYTHON" -c 'import json, sys
p = json.load(open(sys.argv[1])).get("parallel", {})
print(p.get("tensor_model_parallel_size", 1), p.get("pipeline_model_parallel_size", 1), p.get("data_parallel_size") or 0)' "$CONFIG")
WORLD=$((NNODES * GPUS_PER_NODE))
if [[ $DP -gt 0 && $WORLD -ne $((TP * PP * DP)) ]]; then
  die "$HOSTFILE has $NNODES node(s) x $GPUS_PER_NODE GPUs = $WORLD ranks, but $CONFIG expects tp $TP x pp $PP x dp $DP = $((TP * PP * DP)): list $((TP * PP * DP / GPUS_PER_NODE)) nodes"
fi
[[ $((WORLD % (TP * PP))) -eq 0 ]] || die "$WORLD ranks do not divide by tp $TP x pp $PP"

# The environment every rank needs. DeepSpeed's launcher forwards only NCCL*/PYTHON* variables to the other
# nodes, so the rest travels in a DeepSpeed env file (DS_ENV_FILE: KEY=VALUE lines).
ENV_LINES=(
  "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"          # 8 ranks share a node's cores: no oversubscription
  "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"              # a dead peer ends the job instead of a silent hang
  "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
  # Synchronous kernel launches: with asynchronous ones the 176B prequel log's pipeline hung at 160-320 GPUs (the
  # README's "Multi-node" gives the cost). Set CUDA_LAUNCH_BLOCKING=0 to try the faster asynchronous mode once the
  # hang is understood.
  "CUDA_LAUNCH_BLOCKING=${CUDA_LAUNCH_BLOCKING:-1}"
)
[[ -n ${NCCL_SOCKET_IFNAME:-} ]] && ENV_LINES+=("NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME")
[[ -n ${NCCL_IB_HCA:-} ]] && ENV_LINES+=("NCCL_IB_HCA=$NCCL_IB_HCA")

CMD=("$DEEPSPEED" --hostfile "$HOSTFILE" --num_nodes "$NNODES" --num_gpus "$GPUS_PER_NODE"
     --master_port "$MASTER_PORT" pretrain_gpt.py --config "$CONFIG" "$@")

if [[ $DRY_RUN == 1 ]]; then
  echo "# $NNODES node(s) x $GPUS_PER_NODE GPUs = $WORLD ranks (tp $TP x pp $PP x dp $((WORLD / (TP * PP))))"
  printf 'export %s\n' "${ENV_LINES[@]}"
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi

ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/gptpar_deepspeed_env.XXXXXX")
printf '%s\n' "${ENV_LINES[@]}" > "$ENV_FILE"
export DS_ENV_FILE=$ENV_FILE
for line in "${ENV_LINES[@]}"; do export "${line?}"; done
exec "${CMD[@]}"
