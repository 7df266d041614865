#!/usr/bin/env bash
# Show training logs from the workers (process 0 -- worker 0 -- prints the progress lines;
# the others print only their own errors).
#
#   tpu_scripts/logs.sh --project P --zone us-east5-a --name ar-8b [--worker all] [--follow] [--dry-run]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: tpu_scripts/logs.sh [options]
  --worker W    worker index, or "all" (default 0)
  --lines N     last N lines (default 100)
  --follow      keep streaming (Ctrl-C to stop; training continues)
$COMMON_USAGE
USAGE
}

WORKER=0
LINES=100
FOLLOW=0
while (($#)); do
  case "$1" in
    --worker) [[ $# -ge 2 && "$2" =~ ^([0-9]+|all)$ ]] || die "--worker needs an index or all"; WORKER=$2; shift 2 ;;
    --lines) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--lines needs a number"; LINES=$2; shift 2 ;;
    --follow) FOLLOW=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME

tail_flags="-n $LINES"
((FOLLOW)) && tail_flags+=" -F"
tpu_ssh "$WORKER" "tail $tail_flags $REMOTE_DIR/logs/train-*.log"
