#!/usr/bin/env bash
# bash scripts/setup_mooncake.sh [PYTHON ...]       # default: python3 on PATH
#
# Installs the Mooncake Store client (the `mooncake` transport: states carried from SGLang capture servers to
# trainers on other machines; docs/scale-out.md "Online across machines") into each given Python: the trainer's
# and the one that runs SGLang (its capture plugin puts the states into the store).
#   - the system's libibverbs (Debian/Ubuntu package libibverbs1): every Mooncake wheel links libibverbs.so.1,
#     even for TCP on a machine without RDMA, and does not bundle it; installed with apt-get when missing;
#   - mooncake-transfer-engine-non-cuda at the version eagle3 is tested with, unless a Mooncake of that version is
#     already there (a CUDA machine may have mooncake-transfer-engine, the CUDA build: the same module, kept; the
#     builds overwrite each other, so never install a second one beside it).
# Idempotent. Needs root (or sudo) for apt-get only when libibverbs is missing.
set -euo pipefail

VERSION="0.3.13.post1"
PYTHONS=("$@")
[ ${#PYTHONS[@]} -eq 0 ] && PYTHONS=(python3)

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "installing libibverbs1 (Mooncake links libibverbs.so.1)"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

for PY in "${PYTHONS[@]}"; do
    if "$PY" - "$VERSION" <<'PYCHECK' 2>/dev/null; then
import importlib.metadata as m, sys
dists = m.packages_distributions().get("mooncake", [])
sys.exit(0 if any(m.version(d) == sys.argv[1] for d in dists) else 1)
PYCHECK
        echo "Mooncake $VERSION already in $PY"
    else
        "$PY" -m pip install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==$VERSION"
    fi
    "$PY" -c "import mooncake.store; print('OK: mooncake.store importable in', __import__('sys').executable)"
done
