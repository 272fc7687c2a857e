#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything a GPU session runs, into .gpu/ (ignored by git):
# the birdtrain binary, the GPU test binary (tests/gpu; its #[ignore]d tests need a GPU, one
# module per area: cuda_kernels, cuda_step, train_gpu_ranks, …) as .gpu/gpu, and the PyTorch
# peer. Then hand .gpu to the GPU machine and run scripts/gpu-run.sh there (see docs/gpu-journal.md),
# which picks the tests by module (`gpu-run.sh tests cuda_kernels dist_gpu`).
# For the time-to-accuracy phase (`gpu-run.sh tta`) it also copies benches/fashion_mnist/ into
# .gpu/fashion_mnist/ and, when Debian's dataset-fashion-mnist is installed here
# (apt-get install -y dataset-fashion-mnist), its four idx .gz files (30 MB; the GPU machine has
# no network) into .gpu-data/fashion-mnist/, beside .gpu rather than in it: a device call
# carries at most 64 MiB, the working tree included, and .gpu is 31 MB without them. The tta
# call carries what it needs alone: .gpu/birdtrain, .gpu/gpu-run.sh, .gpu/gpu_checks.py,
# .gpu/fashion_mnist and .gpu-data (about 45 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
    echo "usage: gpu-build.sh (no arguments: it builds the one GPU test binary, whose tests gpu-run.sh picks by module)" >&2
    exit 2
fi
export CARGO_PROFILE_RELEASE_DEBUG=0
. scripts/python-venv.sh
cargo build --release --bin birdtrain
rm -rf .gpu && mkdir -p .gpu
cargo test --release --no-run --message-format=json --test gpu \
  | jq -r 'select(.executable != null and .target.kind == ["test"]) | "\(.target.name) \(.executable)"' \
  | while read -r name exe; do cp "$exe" ".gpu/$name"; done
[ -x .gpu/gpu ] || { echo "error: no test binary gpu was built" >&2; exit 1; }
cp target/release/birdtrain scripts/gpu-run.sh scripts/gpu_checks.py .gpu/
cp ../shared/peers/torch_resnet_step.py .gpu/ 2>/dev/null || echo "note: ../shared/peers/torch_resnet_step.py not found; copy the peer into .gpu/ by hand"
mkdir -p .gpu/fashion_mnist && cp benches/fashion_mnist/*.py .gpu/fashion_mnist/
fmnist=/usr/share/datasets/fashion-mnist
if [ -f "$fmnist/train-images-idx3-ubyte.gz" ]; then
    rm -rf .gpu-data && mkdir -p .gpu-data/fashion-mnist && cp "$fmnist"/*-ubyte.gz .gpu-data/fashion-mnist/
else
    echo "note: $fmnist not found (apt-get install -y dataset-fashion-mnist): gpu-run.sh tta will have no data"
fi
"$venv/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps \
    ./python -w .gpu/
mkdir -p .gpu/python-tests && cp python/tests/*.py .gpu/python-tests/
"$venv/bin/python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.9 --dest .gpu/wheels "pytest>=7,<8.4" exceptiongroup tomli \
    || echo "note: pytest's wheels could not be downloaded: gpu-run.sh python needs pytest on the GPU machine"
strip .gpu/birdtrain .gpu/gpu 2>/dev/null || true
du -sh .gpu .gpu-data 2>/dev/null; ls .gpu
