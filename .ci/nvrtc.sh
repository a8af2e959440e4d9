#!/usr/bin/env bash
# CI compile check of the CUDA kernels, on a machine without a GPU: installs NVRTC, the CUDA
# runtime headers and CCCL (pip wheels pinned to CUDA 13.0.x) into a venv and runs
# `nvrtc-check`, which compiles every kernel variant for sm_90a and sm_80 with NVRTC and fails on
# any compile error, register spill or stack frame, then the unit tests that need NVRTC.
#   .ci/nvrtc.sh            (venv in ${NVRTC_VENV:-target/nvrtc-venv})
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NVRTC_VENV:-target/nvrtc-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CU=$SITE/nvidia/cu13
[ -e "$CU/lib/libnvrtc.so.13" ] || { echo "libnvrtc.so.13 not found under $CU/lib" >&2; exit 1; }
export LD_LIBRARY_PATH="$CU/lib:${LD_LIBRARY_PATH:-}"
export DISTATTN_CUDA_INCLUDE="$CU/include"
export DISTATTN_REQUIRE_NVRTC=1
cargo run --release -q -p distattn-cuda --features cli --bin nvrtc-check -- "$@"
# The unit tests that compile with NVRTC (ignored where it is missing).
cargo test --release -q -p distattn-cuda --all-features --lib -- --ignored with_nvrtc
