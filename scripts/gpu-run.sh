#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu/ built by scripts/gpu-build.sh:
# every GPU test, the kernel check, the step benchmark against the PyTorch peer (same machine,
# same call) and a short NCCL training run with a trace. Logs go to $OUT (or /tmp/gpu-out).
set -uo pipefail
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
# NVRTC + headers: the CUDA toolkit if present, else the pip wheels next to PyTorch.
if [ -f /usr/local/cuda/include/cuda_bf16.h ]; then
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  nv=$(dirname "$(find / -name 'libnvrtc.so*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH=$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export BIRDTRAIN_CUDA_INCLUDE=$(dirname "$(find "$nv/../.." -name cuda_bf16.h 2>/dev/null | head -1)")
fi
# cudarc loads libnccl.so; NCCL's wheels ship only libnccl.so.2.
nccl=$(find / -name 'libnccl.so.2' 2>/dev/null | head -1)
if [ -n "$nccl" ]; then mkdir -p /tmp/nccl-link && ln -sf "$nccl" /tmp/nccl-link/libnccl.so; export LD_LIBRARY_PATH=/tmp/nccl-link:$LD_LIBRARY_PATH; fi
export BIRDTRAIN_KERNEL_CACHE=/tmp/birdtrain-kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
.gpu/birdtrain kernels check --arch sm_90 2>&1 | tail -3 | tee -a "$out/gpu.txt"
for t in cuda_kernels cuda_step cuda_memory cuda_bench_step cuda_optim_state cuda_sync_bn train_gpu dist_gpu; do
  echo "== $t" | tee -a "$out/tests.log"
  timeout 300 .gpu/$t --ignored --test-threads 1 --skip a_rank_that_never_joins 2>&1 | tail -25 | tee -a "$out/tests.log"
done
for m in resnet50 resnet18; do
  timeout 200 .gpu/birdtrain bench step --model $m --batch-size 256 --json --breakdown 2>&1 | tail -1 | tee -a "$out/bench.jsonl"
  timeout 200 python3 .gpu/torch_resnet_step.py --model $m --batch-size 256 2>&1 | tail -1 | tee -a "$out/bench.jsonl"
done
# The v1 convolutions (BIRDTRAIN_CONV=v1) beside v2 (the default, above): per-kernel breakdown.
BIRDTRAIN_CONV=v1 timeout 200 .gpu/birdtrain bench step --model resnet50 --batch-size 256 --json --breakdown 2>&1 | tail -1 | tee "$out/bench-conv-v1.jsonl"
.gpu/birdtrain synth --out /tmp/s --classes 8 --train-per-class 200 --valid-per-class 20 --size 64x64 >/dev/null
timeout 300 .gpu/birdtrain --data /tmp/s --gpus 1 --model resnet18 --image-size 64 --batch-size 64 --epochs 2 \
  --out /tmp/run1 --cache-dir /tmp/cache --trace "$out/trace.json" 2>&1 | tail -20 | tee "$out/train.log"
timeout 300 .gpu/birdtrain --data /tmp/s --gpus 1 --model resnet18 --image-size 64 --batch-size 64 --epochs 2 \
  --out /tmp/run2 --cache-dir /tmp/cache 2>&1 | grep -iE "data.wait|valid acc" | tee -a "$out/train.log"
