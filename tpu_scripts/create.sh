#!/usr/bin/env bash
# Request a TPU slice as a queued resource and (by default) wait until it is ACTIVE.
#
#   tpu_scripts/create.sh --project P --zone us-east5-a --name ar-8b --type v5p-64 [--spot] [--dry-run]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: tpu_scripts/create.sh [options]
Creates queued resource NAME with one TPU node NAME of --type, then waits for ACTIVE.
  --spot               Spot capacity (cheaper, preemptible; resume with launch.sh after recreating)
  --reserved           use your reservation
  --valid-until D      give up if not provisioned within duration D (e.g. 6h)
  --no-wait            return right after the request is queued
  --poll-seconds S     state polling interval (default 30)
$COMMON_USAGE
USAGE
}

SPOT=0
RESERVED=0
WAIT=1
POLL=30
VALID_UNTIL=""
while (($#)); do
  case "$1" in
    --spot) SPOT=1; shift ;;
    --reserved) RESERVED=1; shift ;;
    --no-wait) WAIT=0; shift ;;
    --valid-until) [[ $# -ge 2 ]] || die "$1 needs a value"; VALID_UNTIL=$2; shift 2 ;;
    --poll-seconds) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "$1 needs a number"; POLL=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME TPU_TYPE
((SPOT && RESERVED)) && die "--spot and --reserved exclude each other"
if [[ -z "$TPU_RUNTIME_VERSION" ]]; then
  TPU_RUNTIME_VERSION=$(default_runtime_version "$TPU_TYPE")
fi

mapfile -t LOC < <(loc_flags)
cmd=(gcloud compute tpus queued-resources create "$TPU_NAME" "--node-id=$TPU_NAME" "${LOC[@]}"
  "--accelerator-type=$TPU_TYPE" "--runtime-version=$TPU_RUNTIME_VERSION")
((SPOT)) && cmd+=(--spot)
((RESERVED)) && cmd+=(--reserved)
[[ -n "$VALID_UNTIL" ]] && cmd+=("--valid-until-duration=$VALID_UNTIL")
run "${cmd[@]}"

((WAIT)) || exit 0
describe=(gcloud compute tpus queued-resources describe "$TPU_NAME" "${LOC[@]}" "--format=value(state.state)")
if ((DRY_RUN)); then
  echo "# repeated every ${POLL}s until the state is ACTIVE:"
  print_cmd "${describe[@]}"
  exit 0
fi
while true; do
  state=$("${describe[@]}")
  echo "queued resource $TPU_NAME: $state" >&2
  case "$state" in
    ACTIVE) exit 0 ;;
    FAILED | SUSPENDED | SUSPENDING)
      die "queued resource $TPU_NAME is $state; details: gcloud compute tpus queued-resources describe $TPU_NAME"
      ;;
  esac
  sleep "$POLL"
done
