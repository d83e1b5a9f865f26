#!/usr/bin/env bash
# Run one jrl command on every worker of a Cloud TPU VM pod slice (multi-host).
#
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- jrl train --config NAME
#
# Every worker (host) of the slice runs the SAME command, one JAX process per host, all started
# by one `gcloud ... ssh --worker=all`. The command must call jrl.parallel.initialize() before it
# touches JAX; with JRL_COORDINATOR=auto that calls jax.distributed.initialize() with no
# arguments, which reads the slice's topology (worker count, this worker's index, worker 0's
# address) from the TPU VM environment. jax.devices() then lists every chip of the slice, and
# jrl.parallel.make_mesh lays them out topology-aware.
#
# Prerequisites (not done here): the repo at the same path on every worker (e.g. git clone in
# a startup script, or `gcloud compute tpus tpu-vm scp --worker=all`), its virtual environment
# built there with jax[tpu], and any data / checkpoint directory on shared storage (a gs://
# bucket for Orbax checkpoints: every process writes its own shards of the state).
#
# Environment knobs (optional):
#   JRL_REPO      repo path on the workers          (default: ~/jrl)
#   JRL_VENV      venv path on the workers          (default: $JRL_REPO/.venv)
#   JRL_INIT_TIMEOUT_S  seconds to wait for all hosts (default: 300)
#   JRL_DRY_RUN=1 print the gcloud command instead of running it
set -euo pipefail

usage() {
  echo "usage: $0 TPU_NAME ZONE [PROJECT] -- COMMAND [ARGS...]" >&2
  exit 2
}

[[ $# -ge 3 ]] || usage
TPU_NAME=$1; ZONE=$2; shift 2
PROJECT=""
if [[ $1 != "--" ]]; then PROJECT=$1; shift; fi
[[ $# -ge 2 && $1 == "--" ]] || usage
shift

REPO=${JRL_REPO:-'~/jrl'}
VENV=${JRL_VENV:-"$REPO/.venv"}
TIMEOUT_S=${JRL_INIT_TIMEOUT_S:-300}

# The command, quoted once for the remote shell.
REMOTE_CMD=$(printf '%q ' "$@")

# Each worker: cd to the repo, activate the venv, and run the command with auto-detection.
# Output of all workers is interleaved by gcloud, each line prefixed with its worker index.
REMOTE="cd $REPO && source $VENV/bin/activate && \
export JRL_COORDINATOR=auto JRL_INIT_TIMEOUT_S=$TIMEOUT_S && \
exec $REMOTE_CMD"

GCLOUD=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all
        --command="$REMOTE")
if [[ -n $PROJECT ]]; then GCLOUD+=(--project="$PROJECT"); fi

if [[ ${JRL_DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${GCLOUD[@]}"; echo
  exit 0
fi
# If one worker fails, the others block in their next collective until the distributed
# heartbeat times out (jax.distributed: 100 s) and then exit; gcloud returns non-zero.
exec "${GCLOUD[@]}"
