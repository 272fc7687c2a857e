#!/usr/bin/env bash
# The project's test command (the README's second command; CI runs it through .ci/run).
# 1. installs NVRTC + CUDA headers from PyPI wheels (no GPU needed), and PyTorch and torchvision
#    for the reference tests (Debian's packages, scripts/install-test-peers.sh),
# 2. runs every test of the workspace (GPU tests are #[ignore]d) and fails on any panic
#    message in its output; a reference test whose peer is missing fails, it does not skip,
# 3. compiles every CUDA kernel with NVRTC for sm_80, sm_90 and sm_90a (Hopper's own target),
# 4. builds the API docs, warnings as errors,
# 5. builds the Python package (python/) and runs its pytest suite (scripts/test-python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-cuda-tools.sh
. scripts/cuda-env.sh
# Where the peers cannot be installed, the tests comparing with them fail and say why.
bash scripts/install-test-peers.sh \
    || echo "warning: the PyTorch/torchvision reference tests will fail (see above)" >&2
export BIRDTRAIN_REQUIRE_PEERS=1
# Every panic is a bug. CLI tests fail on a panic of the binary themselves; this catches the
# rest: a "panicked at" line in the output of a run where every test passed comes from a
# thread whose output the harness did not capture (and whose error may have been swallowed).
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace 2>&1 | tee "$log"
if grep -n "panicked at" "$log"; then
    echo "error: the test output shows a panic (lines above) although the tests passed" >&2
    exit 1
fi
cargo run --quiet -- kernels check --arch sm_80,sm_90,sm_90a
# The API docs build without a warning (broken links, private items named in public docs).
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --workspace
# The input engine's Python package: built as a user builds it, tested against torch.
bash scripts/test-python.sh
