"""What eagle3 knows about a target without loading it: its `config.json`, read in one place, and a cheap
identity of its weight files (`weights_id`, recorded in every cache fingerprint).

    from eagle3.targets.info import read_target_info
    info = read_target_info("bundled:smollm2-135m-instruct")     # or a folder (target.path)
    info.num_layers, info.hidden_size, info.vocab_size, info.family, info.tied

Kimi-K2.5 ships as a multimodal wrapper: its LLM's config sits in `text_config` while the model's own
`architectures` / `model_type` (`KimiK25ForConditionalGeneration`, `kimi_k25`) stay on the outer config. Every
stage needs a different part of that file (prepare the vocab, extraction the depth, the cache fingerprint the
architectures, the trainer the head's dimensions, SGLang the layer-id family); reading it with one rule here is
what keeps a wrapped target from being read five ways.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.bundled import bundled_context_window, bundled_num_layers, resolve_target_path
from eagle3.layer_ids import ArchFamily, arch_family
from eagle3.rope import context_window


@dataclass(frozen=True)
class TargetInfo:
    folder: Path
    config: dict[str, Any]
    """config.json as written."""
    text: dict[str, Any]
    """The LLM's config: `text_config` of a multimodal wrapper, else `config` itself."""

    @property
    def wrapped(self) -> bool:
        return self.text is not self.config

    @property
    def num_layers(self) -> int:
        return int(self._need("num_hidden_layers"))

    @property
    def hidden_size(self) -> int:
        return int(self._need("hidden_size"))

    @property
    def vocab_size(self) -> int:
        return int(self._need("vocab_size"))

    @property
    def architectures(self) -> list[str]:
        """The model's own class names (the wrapper's for Kimi-K2.5): what the cache fingerprint records."""
        return list(self.config.get("architectures") or self.text.get("architectures") or [])

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type") or self.text.get("model_type") or "")

    @property
    def family(self) -> ArchFamily:
        """The layer-id spelling family (eagle3.layer_ids), from every name the file gives."""
        names = list(self.config.get("architectures") or []) + list(self.text.get("architectures") or [])
        return arch_family(names, f"{self.config.get('model_type', '')} {self.text.get('model_type', '')}")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, Kimi): engines pick their MLA kernels for it."""
        return bool(self.text.get("kv_lora_rank"))

    @property
    def mrope(self) -> bool:
        """Multimodal RoPE (Qwen2.5-VL): three position rows, which a picture moves off the token index; Kimi-K2.5's
        positions are 1-D."""
        rope = self.text.get("rope_parameters") or self.text.get("rope_scaling") or {}
        return isinstance(rope, dict) and "mrope_section" in rope

    @property
    def tied(self) -> bool:
        """Whether the lm_head is the embedding matrix."""
        return bool(self.text.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))

    @classmethod
    def of(cls, config: dict[str, Any], folder: str | Path = ".") -> TargetInfo:
        """The one unwrapping rule: a `text_config` that describes a decoder (has its depth) is the LLM."""
        text = config.get("text_config")
        wrapped = isinstance(text, dict) and "num_hidden_layers" in text
        return cls(Path(folder), config, text if wrapped else config)

    def _need(self, key: str) -> Any:
        if key not in self.text:
            where = "text_config" if self.wrapped else "the top level"
            raise ValueError(f"{self.folder / 'config.json'}: missing {key!r} (looked in {where})")
        return self.text[key]


def read_target_info(path: str | Path) -> TargetInfo:
    """The TargetInfo of a model folder or a `bundled:` name (`target.path`); FileNotFoundError when the folder
    has no config.json."""
    folder = resolve_target_path(str(path))
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target.path: no config.json in {folder}")
    return TargetInfo.of(json.loads(path.read_text()), folder)


def llm_config(info: TargetInfo, quantization: bool = True) -> Any:
    """transformers' config of the target's LLM (Kimi-K2.5's `text_config`). Kimi-K2.5 writes `model_type: kimi_k2`
    there, a name transformers does not register: it is DeepseekV3 (transformers' own Kimi_K25Config and SGLang read
    it so). `quantization=False` leaves out `quantization_config`, for a loader that reads the weights itself
    (eagle3.targets.quantized)."""
    from transformers import AutoConfig

    text = dict(info.text)
    if text.get("model_type") == "kimi_k2":
        text["model_type"] = "deepseek_v3"
    if not quantization:
        text.pop("quantization_config", None)
    return AutoConfig.for_model(**text)


_SAMPLE_BYTES = 1 << 16


def _sample_file(path: Path, h: Any) -> None:
    """Feed 64 KiB from the start, the middle and the end of a file into `h`: the start of a safetensors file
    is its header (names, shapes), the middle and end are tensor values."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        for off in sorted({0, max(size // 2 - _SAMPLE_BYTES // 2, 0), max(size - _SAMPLE_BYTES, 0)}):
            f.seek(off)
            h.update(f.read(_SAMPLE_BYTES))


def weights_id(folder: str | Path, revision: str | None = None) -> str:
    """A cheap identity of the target weights: names and sizes of the weight files, 192 KiB sampled from each
    (start, middle, end), and the safetensors index when there is one. Hashing Kimi's hundreds of GB of weights is not an
    option, but names and sizes alone cannot tell a fine-tune (or a re-download into the same folder) from the
    model it came from: same shapes, other values; the samples can (reading ~12 MB for Kimi's 64 files)."""
    d = Path(folder)
    h = hashlib.sha256()
    files = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file())
    for p in files:
        h.update(f"{p.name}:{p.stat().st_size}\n".encode())
        _sample_file(p, h)
    for idx in sorted(d.glob("*.index.json")):
        h.update(idx.read_bytes())
    if revision:
        h.update(f"revision:{revision}".encode())
    if not files:
        raise FileNotFoundError(f"target.path: no weight files (*.safetensors) in {folder}")
    return h.hexdigest()[:16]


def target_num_layers(path: str, num_layers: int | None = None) -> int | None:
    """The target's depth without loading weights: `num_layers` (target.num_layers) where given, else a bundled
    model's or a local config.json's; None where this machine cannot see it (a remote SGLang target)."""
    if num_layers is not None:
        return num_layers
    n = bundled_num_layers(path)
    if n is not None:
        return n
    try:
        return read_target_info(path).num_layers
    except (OSError, ValueError):  # no folder here yet (a remote SGLang target), or an unreadable file
        return None


def target_context_window(path: str) -> tuple[int, str] | None:
    """(tokens, where it was read) of the longest sequence the engines serve the target at, without loading weights
    (eagle3.rope.context_window of its config.json: max_position_embeddings, scaled for linear RoPE); None where
    this machine cannot see the target's config (a remote SGLang target)."""
    n = bundled_context_window(path)
    if n is not None:
        return n, path
    try:
        info = read_target_info(path)
    except (OSError, ValueError):
        return None
    n = context_window(info.text)
    return (n, str(info.folder / "config.json")) if n else None
