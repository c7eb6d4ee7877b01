#!/usr/bin/env bash
# bash scripts/gpu_wheels.sh [DIR]      (default .whl/, ignored by git; run here, where pip reaches PyPI)
#
# The wheels eagle3 needs on the lent GPU machine (Python 3.12, x86-64, no network) beyond what its image holds
# (torch, transformers, accelerate, tokenizers, safetensors, numpy, pandas, pyyaml, tqdm, rich, pytest; the device
# tool's KINDS.md): datasets and pydantic with their own needs, and pyarrow and typing-extensions at the versions
# datasets and pydantic require (the image's may be older). Versions are this checkout's venv's, the ones the test
# suite passed with. The folder travels with the working tree, which must stay under 64 MiB in all: checked here.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY="${PYTHON:-python3}"
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
rm -rf "$DIR" && mkdir -p "$DIR"
pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = ["datasets", "dill", "multiprocess", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
         "typing_extensions", "pyarrow"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
echo "fetching: $pins"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" $pins
"$PY" - "$DIR" <<'PY'
import subprocess, sys
from pathlib import Path

wheels = sum(f.stat().st_size for f in Path(sys.argv[1]).glob("*.whl"))
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, text=True, check=True).stdout.split("\0")
tree = sum(Path(f).stat().st_size for f in listed if f and Path(f).is_file())
mib = 1 << 20
print(f"wheels {wheels / mib:.1f} MiB + working tree {tree / mib:.1f} MiB = {(wheels + tree) / mib:.1f} MiB "
      "of the 64 MiB that travel")
sys.exit("FAIL: over the 64 MiB the device tool carries" if wheels + tree >= 64 * mib else 0)
PY
ls "$DIR"
