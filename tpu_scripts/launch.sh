#!/usr/bin/env bash
# Start the same training command on every worker of the slice (jax.distributed with TPU
# auto-detection via --distributed), detached with nohup, one log file per worker.
#
#   tpu_scripts/launch.sh --project P --zone us-east5-a --name ar-8b --config llama3_8b \
#       --set train.run_dir=/mnt/gcs/my-bucket/runs/llama3_8b [--set key=value ...] [--dry-run]
#
# Relaunching the same command after a preemption resumes from the latest checkpoint in
# train.run_dir (which must be storage every worker shares, e.g. setup.sh --bucket).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: tpu_scripts/launch.sh --config NAME [options] [-- extra trainer args]
  --config NAME        config name in configs/ or a path inside the project (required)
  --set KEY=VALUE      config override, repeatable (e.g. --set train.run_dir=/mnt/gcs/B/runs/x)
  --env KEY=VALUE      environment variable for the trainer, repeatable (e.g. LIBTPU_INIT_ARGS=...)
  --allow-local-run-dir  do not insist that train.run_dir is on a shared /mnt/gcs mount
Logs: ~/$REMOTE_DIR/logs/train-<hostname>.log on each worker (see logs.sh); stop with stop.sh.
$COMMON_USAGE
USAGE
}

CONFIG=""
SETS=()
ENVS=()
EXTRA=()
ALLOW_LOCAL=0
while (($#)); do
  case "$1" in
    --config) [[ $# -ge 2 ]] || die "$1 needs a value"; CONFIG=$2; shift 2 ;;
    --set)
      [[ $# -ge 2 && "$2" == *=* ]] || die "--set needs KEY=VALUE"
      SETS+=("$2"); shift 2 ;;
    --env)
      [[ $# -ge 2 && "$2" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env needs NAME=VALUE"
      ENVS+=("$2"); shift 2 ;;
    --allow-local-run-dir) ALLOW_LOCAL=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME
if [[ -z "$CONFIG" || "$CONFIG" == -* ]]; then
  die "missing --config NAME"
fi

run_dir=""
for kv in "${SETS[@]}"; do
  [[ "$kv" == train.run_dir=* ]] && run_dir=${kv#train.run_dir=}
done
if ((!ALLOW_LOCAL)) && [[ "$run_dir" != /mnt/gcs/* ]]; then
  die "set --set train.run_dir=/mnt/gcs/BUCKET/... (setup.sh --bucket BUCKET): every worker writes its \
shards of each checkpoint there, and it must outlive the TPU VMs to resume after a preemption. \
Use --allow-local-run-dir to override."
fi

# The trainer command line, quoted for the workers' shell.
train=()
((${#ENVS[@]})) && train+=(env "${ENVS[@]}")
train+=(python -m agentrefine_jax.train --config "$CONFIG" --distributed)
for kv in "${SETS[@]}"; do
  train+=(--set "$kv")
done
((${#EXTRA[@]})) && train+=("${EXTRA[@]}")
train_line=$(print_cmd "${train[@]}")

# The wrapper each worker runs detached: `trap true TERM` keeps it alive while the trainer
# handles SIGTERM (save, exit 75) so the exit code still reaches the log; `set -x` logs the
# exact command. Relative paths in configs (data files) resolve inside the project.
# shellcheck disable=SC2016  # expanded on the workers
wrapper="trap true TERM; source ~/$REMOTE_VENV/bin/activate && cd ~/$REMOTE_DIR || exit 1; \
echo \"[launch] \$(date -u +%FT%TZ) on \$(hostname)\"; set -x; $train_line; \
{ rc=\$?; set +x; } 2>/dev/null; echo \"[launch] trainer exited with code \$rc at \$(date -u +%FT%TZ)\""
# setsid: the pid file holds a process-group id, so stop.sh signals the trainer itself.
# shellcheck disable=SC2016
remote="set -euo pipefail; $REMOTE_ALIVE_FN; mkdir -p $REMOTE_DIR/logs; pidf=$REMOTE_DIR/logs/train.pid; \
if [ -f \$pidf ] && alive \"\$(cat \$pidf)\"; then \
echo \"\$(hostname): training already running (process group \$(cat \$pidf)); run stop.sh first\" >&2; exit 1; fi; \
log=$REMOTE_DIR/logs/train-\$(hostname).log; \
setsid nohup bash -c $(shell_quote "$wrapper") >> \$log 2>&1 < /dev/null & \
echo \$! > \$pidf; echo \"\$(hostname): started (process group \$!), log ~/\$log\""
tpu_ssh all "$remote"
