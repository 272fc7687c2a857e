#!/usr/bin/env bash
# Installs what `birdtrain kernels check` needs on a machine without CUDA: the NVRTC library and
# the CUDA headers (cuda_bf16.h, ...) from NVIDIA's PyPI wheels, pinned to CUDA 13.0, into
# .tools/cuda. No GPU and no driver are needed to compile kernels.
# Also installs NVIDIA's nvdisasm and cuobjdump wheels (for `birdtrain kernels report`) into
# .tools/cuda-bin, pinned to 13.2.51: the oldest 13.x release of those wheels; they read the
# sm_80/sm_90 cubins NVRTC 13.0 writes.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.tools/cuda-bin
bin_stamp=$bin/.installed-13.2.51
if [ ! -f "$bin_stamp" ]; then
  rm -rf "$bin"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$bin" \
    nvidia-cuda-nvdisasm==13.2.51 nvidia-cuda-cuobjdump==13.2.51
  for tool in nvdisasm cuobjdump; do
    test -x "$bin/nvidia/cu13/bin/$tool" || { echo "$tool missing after install" >&2; exit 1; }
  done
  touch "$bin_stamp"
fi
dest=.tools/cuda
stamp=$dest/.installed-13.0.88
if [ -f "$stamp" ]; then exit 0; fi
rm -rf "$dest"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dest" \
  nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.88
test -f "$dest/nvidia/cu13/lib/libnvrtc.so.13" || { echo "libnvrtc.so.13 missing after install" >&2; exit 1; }
touch "$stamp"
