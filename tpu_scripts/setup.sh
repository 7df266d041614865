#!/usr/bin/env bash
# Install the project on every worker of the slice: copy this source tree (or clone a
# repository), install JAX for TPU and the package, optionally mount a GCS bucket with
# gcsfuse (shared run directory for multi-host checkpoints), then check that JAX sees
# every chip of the slice.
#
#   tpu_scripts/setup.sh --project P --zone us-east5-a --name ar-8b [--bucket my-bucket] [--dry-run]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$HERE/common.sh"
REPO_ROOT=$(cd "$HERE/.." && pwd)

usage() {
  cat <<USAGE
usage: tpu_scripts/setup.sh [options]
  --repo URL           git clone URL on the workers instead of copying this source tree
  --ref REF            branch/tag/commit to check out with --repo (default: the default branch)
  --jax-version V      install jax[tpu]==V (default \$JAX_VERSION or $DEFAULT_JAX_VERSION)
  --bucket B           mount gs://B at /mnt/gcs/B on every worker (gcsfuse); put train.run_dir there
  --python P           interpreter to build the virtualenv from (default \$PYTHON_BIN or python3.11)
  --no-check           skip the final device-count check
  --tarball PATH       where to build the source archive (default \$SRC_TARBALL or /tmp/agentrefine_jax-src.tar.gz)
$COMMON_USAGE
USAGE
}

# The JAX release this project is tested with.
DEFAULT_JAX_VERSION=0.10.2
PYTHON_BIN=${PYTHON_BIN:-python3.11}
JAX_VERSION=${JAX_VERSION:-$DEFAULT_JAX_VERSION}
REPO_URL=""
REPO_REF=""
BUCKET=""
CHECK=1
SRC_TARBALL=${SRC_TARBALL:-/tmp/agentrefine_jax-src.tar.gz}
while (($#)); do
  case "$1" in
    --repo) [[ $# -ge 2 ]] || die "$1 needs a value"; REPO_URL=$2; shift 2 ;;
    --ref) [[ $# -ge 2 ]] || die "$1 needs a value"; REPO_REF=$2; shift 2 ;;
    --jax-version) [[ $# -ge 2 ]] || die "$1 needs a value"; JAX_VERSION=$2; shift 2 ;;
    --bucket) [[ $# -ge 2 ]] || die "$1 needs a value"; BUCKET=${2#gs://}; BUCKET=${BUCKET%/}; shift 2 ;;
    --tarball) [[ $# -ge 2 ]] || die "$1 needs a value"; SRC_TARBALL=$2; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die "$1 needs a value"; PYTHON_BIN=$2; shift 2 ;;
    --no-check) CHECK=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *)
      common_flag "$@"
      ((COMMON_SHIFT)) || die "unknown option $1 (see --help)"
      shift "$COMMON_SHIFT"
      ;;
  esac
done
require TPU_PROJECT TPU_ZONE TPU_NAME
[[ -n "$REPO_REF" && -z "$REPO_URL" ]] && die "--ref needs --repo"
[[ -z "$BUCKET" || "$BUCKET" =~ ^[a-z0-9][a-z0-9._-]*$ ]] || die "--bucket $BUCKET is not a bucket name"
mapfile -t LOC < <(loc_flags)
ARCHIVE=$(basename "$SRC_TARBALL")

# 1. Source code on every worker.
if [[ -n "$REPO_URL" ]]; then
  fetch="rm -rf $REMOTE_DIR && git clone $(shell_quote "$REPO_URL") $REMOTE_DIR"
  if [[ -n "$REPO_REF" ]]; then
    fetch+=" && git -C $REMOTE_DIR checkout $(shell_quote "$REPO_REF")"
  fi
else
  # The working tree as it is (uncommitted changes included), minus caches and runs.
  run tar -czf "$SRC_TARBALL" --exclude=.git --exclude=runs --exclude=__pycache__ \
    --exclude=.pytest_cache --exclude=.ruff_cache --exclude='*.egg-info' -C "$REPO_ROOT" .
  run gcloud compute tpus tpu-vm scp "$SRC_TARBALL" "$TPU_NAME:$ARCHIVE" "${LOC[@]}" --worker=all
  fetch="rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf $ARCHIVE -C $REMOTE_DIR"
fi

# 2. Python >= 3.11 in a virtualenv (the TPU images ship 3.10), JAX for TPU (libtpu comes
#    from PyPI) and the package, editable so a re-setup only refreshes the code; its `gcs` extra
#    (gcsfs) lets train.run_dir be a gs:// URL as well as a gcsfuse mount.
install="sudo apt-get update -q && sudo apt-get install -y -q $PYTHON_BIN $PYTHON_BIN-venv"
install+=" && { [ -x $REMOTE_PY ] || $PYTHON_BIN -m venv $REMOTE_VENV; }"
install+=" && $REMOTE_PY -m pip install --upgrade pip"
install+=" && $REMOTE_PY -m pip install $(shell_quote "jax[tpu]==$JAX_VERSION") -e $(shell_quote "./${REMOTE_DIR}[gcs]")"
tpu_ssh all "set -euo pipefail; $fetch && $install"

# 3. Optional shared run directory: the same bucket mounted at the same path on every worker.
if [[ -n "$BUCKET" ]]; then
  mnt=/mnt/gcs/$BUCKET
  # shellcheck disable=SC2016  # expanded on the workers, not here
  apt_gcsfuse='echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null && curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null && sudo apt-get update -q && sudo apt-get install -y -q gcsfuse'
  # Orbax commits a checkpoint by renaming its temporary directory: allow directory renames.
  # shellcheck disable=SC2016
  mount="sudo mkdir -p $mnt && sudo chown \"\$(id -u):\$(id -g)\" $mnt && { mountpoint -q $mnt || gcsfuse --implicit-dirs --rename-dir-limit=1000000 $BUCKET $mnt; }"
  tpu_ssh all "set -euo pipefail; command -v gcsfuse >/dev/null || { $apt_gcsfuse; }; $mount"
fi

# 4. Every worker must see the whole slice (run on all workers at once, as training does).
if ((CHECK)); then
  tpu_ssh all "$REMOTE_PY -c 'import jax; print(\"process\", jax.process_index(), \"of\", jax.process_count(), \"sees\", jax.device_count(), \"devices\", jax.devices()[0].device_kind)'"
fi
