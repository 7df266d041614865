#!/usr/bin/env bash
# Delete the queued resource and its TPU node (stops billing). Checkpoints on a bucket survive.
#
#   tpu_scripts/delete.sh --project P --zone us-east5-a --name ar-8b [--dry-run]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: tpu_scripts/delete.sh [options]
Deletes queued resource NAME and, with it, TPU node NAME (no confirmation prompt).
  --async   do not wait for the deletion to finish
$COMMON_USAGE
USAGE
}

ASYNC=0
while (($#)); do
  case "$1" in
    --async) ASYNC=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME

mapfile -t LOC < <(loc_flags)
cmd=(gcloud compute tpus queued-resources delete "$TPU_NAME" "${LOC[@]}" --force --quiet)
((ASYNC)) && cmd+=(--async)
run "${cmd[@]}"
