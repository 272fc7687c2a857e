# Sourced by scripts/test-python.sh and scripts/gpu-build.sh: the virtual environment that
# builds the Python package (`python/`, the `birdtrain` PyTorch loader). Sets $venv and puts
# its bin/ first on PATH (pip's build of ./python runs the environment's maturin).
#
# PYTHON picks the interpreter, one that has torch, torchvision and Pillow (default
# /usr/bin/python3: Debian's python3-torch, python3-torchvision, python3-pil); the
# environment sees its packages, so nothing large is downloaded (maturin and pytest are).
# Idempotent: a second run reuses the environment.
python="${PYTHON:-/usr/bin/python3}"
venv=python/.venv
if ! "$python" -c "import torch, torchvision, PIL" 2>/dev/null; then
    echo "error: $python lacks torch, torchvision or Pillow (on Debian: apt-get install python3-torch python3-torchvision python3-pil; or set PYTHON)" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv"
fi
export PATH="$PWD/$venv/bin:$PATH"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin>=1.5,<2" pytest
