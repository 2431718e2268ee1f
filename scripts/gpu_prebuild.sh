#!/usr/bin/env bash
# Build the C core here for the device machine's Python (3.12 by default), in
# case its image lacks the Python headers that gpu_check.sh's in-place build
# needs: the result goes to .gpu/ (git-ignored), which a device run carries.
#   scripts/gpu_prebuild.sh [python-version]      then run with carry [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${1:-3.12}
PY=$(ls -d /root/.pyenv/versions/"$VER"*/bin/python"$VER" 2>/dev/null | head -1 || true)
PY=${PY:-$(command -v python"$VER" || true)}
[ -n "$PY" ] || { echo "no python$VER here"; exit 1; }
INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUF=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
mkdir -p .gpu
# the flags of setup.py
gcc -shared -fPIC -std=gnu11 -O3 -ffp-contract=off -fno-fast-math -Wall -Wextra \
    -Wno-missing-field-initializers -I"$INC" src/tpcomm/_native/*.c -o ".gpu/_native$SUF" -lpthread
echo "built .gpu/_native$SUF with $PY"
