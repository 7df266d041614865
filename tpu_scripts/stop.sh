#!/usr/bin/env bash
# Stop training on every worker. SIGTERM (the default) makes the trainer save a checkpoint
# at the next step all hosts agree on and exit with code 75; relaunching resumes from it.
#
#   tpu_scripts/stop.sh --project P --zone us-east5-a --name ar-8b [--kill] [--dry-run]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: tpu_scripts/stop.sh [options]
  --kill         SIGKILL instead of SIGTERM: no final checkpoint (use if a worker hangs)
  --timeout S    wait up to S seconds for the trainer to exit (default 600; 0 = do not wait)
$COMMON_USAGE
USAGE
}

SIGNAL=TERM
TIMEOUT=600
while (($#)); do
  case "$1" in
    --kill) SIGNAL=KILL; shift ;;
    --timeout) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--timeout needs seconds"; TIMEOUT=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME

# launch.sh runs the trainer in its own process group and records the group id.
# shellcheck disable=SC2016  # expanded on the workers
remote="$REMOTE_ALIVE_FN; pidf=$REMOTE_DIR/logs/train.pid; \
if [ ! -f \$pidf ] || ! alive \"\$(cat \$pidf)\"; then echo \"\$(hostname): not running\"; exit 0; fi; \
pg=\$(cat \$pidf); kill -$SIGNAL -- -\$pg; echo \"\$(hostname): sent SIG$SIGNAL to process group \$pg\""
if ((TIMEOUT)); then
  # shellcheck disable=SC2016
  remote+="; for _ in \$(seq $TIMEOUT); do alive \$pg || break; sleep 1; done; \
if alive \$pg; then echo \"\$(hostname): still running after ${TIMEOUT}s\" >&2; exit 1; fi; \
echo \"\$(hostname): stopped\"; tail -n 1 $REMOTE_DIR/logs/train-\$(hostname).log"
fi
tpu_ssh all "$remote"
