#!/usr/bin/env bash
# Installs what `birdtrain kernels check` needs on a machine without CUDA: the NVRTC library and
# the CUDA headers (cuda_bf16.h, ...) from NVIDIA's PyPI wheels, pinned to CUDA 13.0, into
# .tools/cuda. No GPU and no driver are needed to compile kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/cuda
stamp=$dest/.installed-13.0.88
if [ -f "$stamp" ]; then exit 0; fi
rm -rf "$dest"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dest" \
  nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.88
test -f "$dest/nvidia/cu13/lib/libnvrtc.so.13" || { echo "libnvrtc.so.13 missing after install" >&2; exit 1; }
touch "$stamp"
