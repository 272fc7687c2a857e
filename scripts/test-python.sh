#!/usr/bin/env bash
# The Python package's test command: builds `python/` (the `birdtrain` PyTorch loader) into a
# virtual environment and runs its pytest suite on the CPU. Idempotent: a second run reuses
# the environment and cargo's build folder (python/target).
#
# PYTHON picks the interpreter, one that has torch, torchvision and Pillow (default
# /usr/bin/python3: Debian's python3-torch, python3-torchvision, python3-pil); the
# environment sees its packages, so nothing large is downloaded (maturin and pytest are).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-/usr/bin/python3}"
venv=python/.venv
if ! "$python" -c "import torch, torchvision, PIL" 2>/dev/null; then
    echo "error: $python lacks torch, torchvision or Pillow (on Debian: apt-get install python3-torch python3-torchvision python3-pil; or set PYTHON)" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
# pip's build of ./python runs the environment's maturin.
export PATH="$PWD/$venv/bin:$PATH"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin>=1.5,<2" pytest
# The same command a user runs (`pip install ./python`), with the environment's maturin.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps ./python
"$venv/bin/python" -c "import birdtrain, torch; print('birdtrain', birdtrain.__file__, 'torch', torch.__version__)"
"$venv/bin/python" -m pytest -q python/tests "$@"
