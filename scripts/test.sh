#!/usr/bin/env bash
# The project's test command (the README's second command; CI runs it through .ci/run).
# 1. installs NVRTC + CUDA headers from PyPI wheels (no GPU needed),
# 2. runs every test of the workspace (GPU tests are #[ignore]d),
# 3. compiles every CUDA kernel with NVRTC for sm_80 and sm_90.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-cuda-tools.sh
. scripts/cuda-env.sh
cargo test --workspace
cargo run --quiet -- kernels check --arch sm_80,sm_90
