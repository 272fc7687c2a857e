#!/usr/bin/env bash
# The Python package's test command: builds `python/` (the `birdtrain` PyTorch loader) into a
# virtual environment and runs its pytest suite on the CPU. Idempotent: a second run reuses
# the environment and cargo's build folder (python/target).
#
# The environment and its interpreter: scripts/python-venv.sh (PYTHON picks the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python-venv.sh
# The same command a user runs (`pip install ./python`), with the environment's maturin.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps ./python
# The extension's own unit tests (the page-locked buffers against a stand-in driver, the flip),
# in the release profile the build above just compiled the dependencies in.
cargo test --quiet --release --manifest-path python/Cargo.toml --lib
"$venv/bin/python" -c "import birdtrain, torch; print('birdtrain', birdtrain.__file__, 'torch', torch.__version__)"
"$venv/bin/python" -m pytest -q python/tests "$@"
