#!/usr/bin/env bash
# The GPU check of tpcomm.cuda, as one prepared run on a machine with a CUDA GPU
# (for example the workplace's device machine):
#   builds the C core in place, runs tests/gpu (several ranks sharing GPU 0:
#   eager and graph all-reduce at world 2 and 4, all_gather, reduce_scatter,
#   capture-count mismatch, no GPU memory left), then prints the timing table.
# Uses the python3 that has torch with CUDA and Triton (PYTHON overrides it).
# Fits in 5 minutes: each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
$PY - <<'PYEOF' || exit 1
import torch, triton
assert torch.cuda.is_available(), "no CUDA GPU visible"
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0))
PYEOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if ! timeout 120 $PY setup.py -q build_ext --inplace >/tmp/tpcomm-build.log 2>&1; then
    # no Python headers or setuptools there: a core built here by
    # scripts/gpu_prebuild.sh for this Python, carried in .gpu/
    SUF=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    if [ -f ".gpu/_native$SUF" ]; then
        cp ".gpu/_native$SUF" src/tpcomm/ && echo "# C core: prebuilt .gpu/_native$SUF"
    else
        tail -20 /tmp/tpcomm-build.log
        echo "C core build failed, and no .gpu/_native$SUF (scripts/gpu_prebuild.sh)"
        exit 1
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SHM=$(mktemp -d /dev/shm/tpc-gpu-XXXXXX)
export TPCOMM_SHM_DIR=$SHM TPCOMM_CACHE_DIR=$SHM/cache
status=0
timeout 200 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu tests/test_cuda.py \
    -k "not interpreter and not unsupported_sizes" || status=$?
timeout 70 $PY -m tests.gpu.bench || status=$?
left=$(ls "$SHM" | grep -c '^tpcomm-' || true)
echo "# segments left in $SHM: $left"
rm -rf "$SHM"
exit $status
