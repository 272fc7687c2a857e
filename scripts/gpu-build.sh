#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything a GPU session runs, into .gpu/ (ignored by git):
# the birdtrain binary, the #[ignore]d GPU test binaries under stable names, and the PyTorch peer.
# (`gpu-build.sh NAME...`: only those test binaries.)
# Then hand .gpu to the GPU machine and run scripts/gpu-run.sh there (see docs/gpu-journal.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_RELEASE_DEBUG=0
tests=(cuda_kernels cuda_step cuda_memory cuda_bench_step cuda_optim_state cuda_sync_bn train_gpu dist_gpu train_gpu_ranks)
# `gpu-build.sh NAME...` builds only those test binaries (a smaller .gpu for one phase, e.g.
# `gpu-build.sh train_gpu_ranks` for `gpu-run.sh multi`).
[ $# -gt 0 ] && tests=("$@")
cargo build --release --bin birdtrain
args=(); for t in "${tests[@]}"; do args+=(--test "$t"); done
rm -rf .gpu && mkdir -p .gpu
cargo test --release --no-run --message-format=json "${args[@]}" \
  | jq -r 'select(.executable != null and .target.kind == ["test"]) | "\(.target.name) \(.executable)"' \
  | while read -r name exe; do cp "$exe" ".gpu/$name"; done
cp target/release/birdtrain scripts/gpu-run.sh scripts/gpu_checks.py .gpu/
cp ../shared/peers/torch_resnet_step.py .gpu/ 2>/dev/null || echo "note: ../shared/peers/torch_resnet_step.py not found; copy the peer into .gpu/ by hand"
strip .gpu/birdtrain .gpu/cuda_* .gpu/train_gpu .gpu/train_gpu_ranks .gpu/dist_gpu 2>/dev/null || true
du -sh .gpu && ls .gpu
