#!/usr/bin/env bash
# Installs the peers the reference tests compare birdtrain with: PyTorch and torchvision for
# /usr/bin/python3 (tests/model/torch_reference.rs, pipeline/tests/engine/auto_augment.rs), as
# Debian's python3-torch and python3-torchvision (CPU builds, numpy with them). Called by
# scripts/test.sh, which then requires them (BIRDTRAIN_REQUIRE_PEERS=1). Does nothing, quickly,
# when python3 imports them already; exits 1, saying what to install, where it cannot.
set -euo pipefail
python=/usr/bin/python3
imports() { [ -x "$python" ] && "$python" -c "import torch, torchvision, numpy" 2>/dev/null; }
imports && exit 0
if ! command -v apt-get >/dev/null; then
    echo "error: $python cannot import torch and torchvision, and there is no apt-get to install them: install PyTorch and torchvision for $python" >&2
    exit 1
fi
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
# Waits for another apt or dpkg run to finish instead of failing on its lock.
apt=("${sudo[@]}" apt-get -o DPkg::Lock::Timeout=900 -y -q)
packages=(python3-torch python3-torchvision)
echo "installing ${packages[*]} (the reference tests' peers) with apt-get" >&2
# A fresh machine may have no package lists yet: update once if the first try fails.
"${apt[@]}" install --no-install-recommends "${packages[@]}" \
    || { "${apt[@]}" update && "${apt[@]}" install --no-install-recommends "${packages[@]}"; }
if ! imports; then
    echo "error: ${packages[*]} installed, but $python still cannot import torch and torchvision" >&2
    exit 1
fi
