# shellcheck shell=bash
# Shared settings and helpers for the tpu_scripts/*.sh commands. Sourced, never run.
#
# Every setting comes from a flag or, failing that, an environment variable:
#   --project  TPU_PROJECT   (falls back to CLOUDSDK_CORE_PROJECT)
#   --zone     TPU_ZONE      e.g. us-east5-a
#   --name     TPU_NAME      queued-resource id; the TPU node gets the same name
#   --type     TPU_TYPE      accelerator type, e.g. v5p-64 (v4/v5p count TensorCores: v5p-64 = 32 chips)
#   --runtime-version TPU_RUNTIME_VERSION  default: the Cloud TPU image for the type's generation
#   --dry-run  print the gcloud commands instead of running them

TPU_PROJECT=${TPU_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}
TPU_ZONE=${TPU_ZONE:-}
TPU_NAME=${TPU_NAME:-}
TPU_TYPE=${TPU_TYPE:-}
TPU_RUNTIME_VERSION=${TPU_RUNTIME_VERSION:-}
DRY_RUN=${DRY_RUN:-0}
# Where the project lives on every worker (relative to the ssh user's home directory).
REMOTE_DIR=${REMOTE_DIR:-agentrefine_jax}
# Its Python: a virtualenv, because the TPU images ship Python 3.10 and we need >= 3.11.
REMOTE_VENV=${REMOTE_VENV:-agentrefine-venv}
# shellcheck disable=SC2034  # used by the scripts that source this file
REMOTE_PY=$REMOTE_VENV/bin/python
COMMON_SHIFT=0

# shellcheck disable=SC2034  # used by the scripts that source this file
COMMON_USAGE='common options (flag or environment variable):
  --project P          TPU_PROJECT (or CLOUDSDK_CORE_PROJECT)
  --zone Z             TPU_ZONE
  --name N             TPU_NAME
  --type T             TPU_TYPE, e.g. v5p-64
  --runtime-version R  TPU_RUNTIME_VERSION (default from the TPU generation)
  --dry-run            print the gcloud commands, run nothing'

die() {
  echo "error: $*" >&2
  exit 2
}

# Parse one common option at "$@"; sets COMMON_SHIFT to the number of words used (0 = not ours).
common_flag() {
  COMMON_SHIFT=0
  case "$1" in
    --project | --zone | --name | --type | --runtime-version)
      [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value"
      case "$1" in
        --project) TPU_PROJECT=$2 ;;
        --zone) TPU_ZONE=$2 ;;
        --name) TPU_NAME=$2 ;;
        --type) TPU_TYPE=$2 ;;
        --runtime-version) TPU_RUNTIME_VERSION=$2 ;;
      esac
      COMMON_SHIFT=2
      ;;
    --dry-run)
      DRY_RUN=1
      # shellcheck disable=SC2034  # read by the calling script
      COMMON_SHIFT=1
      ;;
  esac
}

# require VAR... : every named setting must be non-empty.
require() {
  local var flag missing=()
  for var in "$@"; do
    if [[ -z "${!var}" ]]; then
      flag=${var#TPU_}
      flag=${flag,,}
      missing+=("--${flag//_/-} (or \$$var)")
    fi
  done
  if ((${#missing[@]})); then
    local joined
    joined=$(printf ', %s' "${missing[@]}")
    die "missing ${joined:2}"
  fi
  if [[ -n "$TPU_TYPE" && ! "$TPU_TYPE" =~ ^v[0-9]+[a-z]*(litepod)?-[0-9]+$ ]]; then
    die "--type $TPU_TYPE does not look like an accelerator type (e.g. v5p-64, v4-32, v5litepod-16, v6e-64)"
  fi
}

# The Cloud TPU software image recommended for JAX on each generation.
default_runtime_version() {
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v4-* | v3-* | v2-*) echo tpu-ubuntu2204-base ;;
    *) die "no default runtime version for --type $1; pass --runtime-version" ;;
  esac
}

# A word quoted for a POSIX shell, left bare when it needs no quoting (readable dry runs).
shell_quote() {
  local s=$1
  if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

# Print a command as one shell-ready line.
print_cmd() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(shell_quote "$word")"
  done
  printf '%s\n' "$out"
}

# A process group is alive while it has a member that is not a zombie.
# shellcheck disable=SC2016,SC2034  # a function definition for the workers' shell
REMOTE_ALIVE_FN='alive() { ps -e -o pgid=,stat= | awk -v g="$1" '"'"'$1 == g && $2 !~ /^Z/ {f = 1} END {exit !f}'"'"'; }'

# Run a command, or only print it under --dry-run. A failure stops the script (set -e).
run() {
  if ((DRY_RUN)); then
    print_cmd "$@"
  else
    echo "+ $(print_cmd "$@")" >&2
    "$@"
  fi
}

# gcloud location flags shared by every TPU command.
loc_flags() {
  printf '%s\n' "--project=$TPU_PROJECT" "--zone=$TPU_ZONE"
}

# Run a remote shell command on the TPU VM workers (WORKER: all, or a worker index).
tpu_ssh() {
  local worker=$1 command=$2
  local -a loc
  mapfile -t loc < <(loc_flags)
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${loc[@]}" "--worker=$worker" "--command=$command"
}
