# Source me: points the dynamic loader and the kernel compiler at .tools/cuda (see install-cuda-tools.sh).
_bt_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LD_LIBRARY_PATH="$_bt_root/.tools/cuda/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BIRDTRAIN_CUDA_INCLUDE="$_bt_root/.tools/cuda/nvidia/cu13/include"
export BIRDTRAIN_CUDA_BIN="$_bt_root/.tools/cuda-bin/nvidia/cu13/bin"
