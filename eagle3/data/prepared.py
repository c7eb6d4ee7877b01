"""The prepared-data folder: the contract between `prepare` and every later stage.

    <prepared_dir>/train/            HF datasets folder: id (str), input_ids (list<int32>), loss_mask (list<int8>)
    <prepared_dir>/eval/             same columns, the held-out split
    <prepared_dir>/vocab.safetensors d2t int64 [draft_vocab] (target = i + d2t[i]), t2d bool [target_vocab]
    <prepared_dir>/meta.json         fingerprint, tokenizer, template, max_length, summary, vocab coverage, and
                                     every other file's size and SHA-256 (checked on every read)

The draft vocab is counted once here and only loaded afterwards: regenerating it on resume silently misaligns
a trained lm_head.

What the folder was made from is part of the contract too: `fingerprint_inputs` (sources, tokenizer, template,
the data settings) is recorded in meta.json, `prepare` reuses a folder whose fingerprint matches, and
`check_prepared` refuses `extract` or `train` on a folder another config made, naming each key with both values.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3.config import DataConfig, DraftConfig, SourceConfig, TargetConfig
from eagle3.data.sources import resolve_source_path
from eagle3.data.templates import ChatTemplate, TemplateError, load_tokenizer, resolve_template
from eagle3.fsutil import damaged_files
from eagle3.logs import UserError
from eagle3.targets.info import read_target_info


class PreparedError(UserError, ValueError):
    """Prepared data that is missing or damaged, phrased for the user (the fix: re-run `eagle3 prepare`)."""


@dataclass
class Prepared:
    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset
    d2t: torch.Tensor
    t2d: torch.Tensor
    meta: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]


def save_vocab(path: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, str(path))


def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d), copied out of the file's mapping: a file rewritten in place must never change a vocab in use."""
    t = load_file(str(path))
    return t["d2t"].clone(), t["t2d"].clone()


def is_prepared(prepared_dir: Path) -> bool:
    return all((prepared_dir / n).exists() for n in ("train", "eval", "vocab.safetensors", "meta.json"))


def read_prepared_meta(prepared_dir: str | Path, check_files: bool = True) -> dict[str, Any]:
    """meta.json, with every file it records checked (size and SHA-256: prepared data is small next to a cache).
    Missing or damaged prepared data is one error that names the file and says to re-run `prepare`, which
    rebuilds it; a cache extracted from the same samples stays valid."""
    d = Path(prepared_dir)
    redo = "re-run `eagle3 prepare --config ...` (it rebuilds them; a cache of the same samples stays valid)"
    if not is_prepared(d):
        raise PreparedError(f"no prepared data in {d} (train/, eval/, vocab.safetensors and meta.json): run "
                            "`eagle3 prepare --config ...` first")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (ValueError, OSError) as e:
        raise PreparedError(f"{d / 'meta.json'} is damaged ({e}): {redo}") from None
    problems = damaged_files(d, meta.get("files", {})) if check_files else []
    if problems:
        raise PreparedError(f"the prepared data in {d} is damaged: {'; '.join(problems)}; {redo}")
    return meta


def load_prepared(prepared_dir: str | Path) -> Prepared:
    from datasets import load_from_disk

    d = Path(prepared_dir)
    meta = read_prepared_meta(d)
    d2t, t2d = load_vocab(d / "vocab.safetensors")
    return Prepared(load_from_disk(str(d / "train")), load_from_disk(str(d / "eval")), d2t, t2d, meta)


def prepared_images(prepared_dir: str | Path) -> list[list[str]]:
    """Every sample's images (train split, then eval), [] per sample where the folder has none."""
    from datasets import load_from_disk

    out: list[list[str]] = []
    for split in ("train", "eval"):
        ds = load_from_disk(str(Path(prepared_dir) / split))
        out += ds["images"] if "images" in ds.column_names else [[] for _ in range(len(ds))]
    return out


def samples_seen_in(samples: Any, split: Any) -> int:
    """How many of `samples` appear, token for token, in `split` (both prepared splits: rows with `input_ids`).
    A held-out split is held out from its own config's training only: prepare shuffles every source's samples together,
    so a config with another source (or seed) draws another split, and a head trained by it may have trained on the
    samples another config holds out (BENCHMARKS.md "Edit requests in the training data")."""
    seen = {tuple(ids) for ids in split["input_ids"]}
    return sum(tuple(ids) in seen for ids in samples["input_ids"])


# ------------------------------------------------------------------------------ what the folder was made from
PREPARE_VERSION = 2
"""Bump when the rendering/masking rules change, so old prepared folders are rebuilt (2: tool conversations are
read and rendered instead of skipped; samples record their source and record)."""
SMALL_FILE_BYTES = 16 << 20
"""Source files up to this size are identified by content hash; bigger ones by path + size + mtime."""


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def own_thinking(src: SourceConfig, data_thinking: bool) -> bool | None:
    """A source's `thinking` where it differs from `data.thinking`, else None: the fingerprint names only a setting
    that changes the rendering (and folders prepared before the key existed keep their fingerprint)."""
    return src.thinking if src.thinking is not None and src.thinking != data_thinking else None


def source_identity(src: SourceConfig, data_thinking: bool = False) -> dict[str, Any]:
    """What identifies a source's content without reading big files: content hash when small, else stat; and its own
    rendering setting (`thinking`). Not its weight: the samples do not depend on it."""
    p = resolve_source_path(src).resolve()
    # a source's own settings only when set: folders prepared before such a key existed keep their fingerprint
    ident = {k: v for k, v in _naming(src, data_thinking).items() if v is not None or k not in _OWN_SETTINGS}
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        listing = [(str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        ident["folder"] = _sha256_bytes(json.dumps([str(p), listing]).encode())
    else:
        st = p.stat()
        if st.st_size <= SMALL_FILE_BYTES:
            ident["sha256"] = _sha256_bytes(p.read_bytes())
        else:
            ident["file"] = [str(p), st.st_size, st.st_mtime_ns]
    return ident


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return {
        "class": type(tokenizer).__name__,
        "len": len(tokenizer),
        "vocab_sha256": _sha256_bytes(json.dumps([vocab, specials], ensure_ascii=False).encode()),
    }


def target_vocab_size(target: TargetConfig, tokenizer: Any) -> int:
    """The target's vocab (lm_head rows) from its config.json (text_config first), else the tokenizer's length.

    A model's vocab is often padded beyond the tokenizer; t2d must cover the model's rows."""
    try:
        size = read_target_info(target.path).text.get("vocab_size")
    except FileNotFoundError:
        size = None
    return size if isinstance(size, int) and size > 0 else len(tokenizer)


def fingerprint_inputs(data: DataConfig, draft: DraftConfig, tokenizer: Any, tpl: ChatTemplate, vocab_size: int
                       ) -> dict[str, Any]:
    return {**_settings(data, draft), "sources": [source_identity(s, data.thinking) for s in data.sources],
            **_target_part(tokenizer, tpl, vocab_size)}


def _settings(d: DataConfig, draft: DraftConfig) -> dict[str, Any]:
    """The fingerprint inputs the config alone decides."""
    return {"version": PREPARE_VERSION, "thinking": d.thinking, "system_prompt": d.system_prompt,
            "max_length": d.max_length, "overlength": d.overlength, "max_samples": d.max_samples,
            "eval_size": d.eval_size, "seed": d.seed, "draft_vocab_size": draft.vocab_size,
            # only when not the default: folders prepared before the key existed keep their fingerprint
            **({"min_length": d.min_length} if d.min_length else {}),
            **({"vocab_from": draft.vocab_from} if draft.vocab_from != "answers" else {})}


VOCAB_KEYS = ("draft_vocab_size", "vocab_from")
"""Fingerprint inputs that decide only the draft vocab: hidden-state caches do not depend on them."""


def _target_part(tokenizer: Any, tpl: ChatTemplate, vocab_size: int) -> dict[str, Any]:
    """The fingerprint inputs the target's tokenizer decides."""
    return {"tokenizer": tokenizer_identity(tokenizer), "target_vocab_size": vocab_size,
            "template": {"name": tpl.name, "sha256": _sha256_bytes(tpl.text.encode()), "eot": list(tpl.eot)}}


def fingerprint(inputs: dict[str, Any]) -> str:
    return _sha256_bytes(json.dumps(inputs, sort_keys=True).encode())


_CONFIG_KEYS = {
    "max_length": "data.max_length", "min_length": "data.min_length", "overlength": "data.overlength",
    "max_samples": "data.max_samples",
    "eval_size": "data.eval_size", "seed": "data.seed", "thinking": "data.thinking",
    "system_prompt": "data.system_prompt", "template": "data.chat_template", "sources": "data.sources",
    "draft_vocab_size": "draft.vocab_size", "vocab_from": "draft.vocab_from",
    "tokenizer": "the target's tokenizer (target.path)",
    "target_vocab_size": "the target's vocab size (target.path)", "version": "the prepare rules (eagle3's version)",
}


_SOURCE_NAMING = ("path", "format", "split", "max_records", "thinking", "join_parts")
_OWN_SETTINGS = ("thinking", "join_parts")
"""A source's settings recorded only where they change the samples (None otherwise)."""


def _naming(src: SourceConfig, data_thinking: bool) -> dict[str, Any]:
    """A source as the config names it (its own `thinking` and `join_parts` as source_identity records them)."""
    own = {"thinking": own_thinking(src, data_thinking), "join_parts": True if src.join_parts else None}
    return {k: own[k] if k in own else getattr(src, k) for k in _SOURCE_NAMING}


def _config_part(fp_in: dict[str, Any]) -> dict[str, Any]:
    """What the config decides of the prepared data: the fingerprint inputs with each source as the config names it
    (a big source file's size and mtime change when it is copied to another machine; its samples do not)."""
    return {**fp_in, "sources": [{k: s.get(k) for k in _SOURCE_NAMING} for s in fp_in.get("sources", [])]}


def check_image_inputs(draft: DraftConfig, prepared_dir: Path) -> None:
    """Prepared data with images: the head's convention at image positions must be chosen first, in one error."""
    where = f"the prepared data in {prepared_dir} holds samples with images"
    if draft.image_inputs is None:
        raise PreparedError(f"{where}: set draft.image_inputs to the engine the head will serve in: `placeholder` "
                            "(vLLM: the placeholder token's embedding at image positions) or `target-embeddings` "
                            "(SGLang: the target's merged image embeddings)")


def check_prepared(data: DataConfig, draft: DraftConfig, target: TargetConfig, prepared_dir: Path,
                   meta: dict[str, Any], stage: str) -> None:
    """Refuse a config that changed the data since `prepare` made it (data.max_length, the template, the sources,
    draft.vocab_size for training, ...): `extract` and `train` would otherwise run on the old data. Names each key
    with both values and the command that re-prepares. A folder `prepare` did not write (no recorded inputs) has
    nothing to compare; where the target has no tokenizer, the keys that need one are not compared."""
    then = meta.get("fingerprint_inputs")
    if then is None:
        return
    if "images" in then:
        check_image_inputs(draft, prepared_dir)
    # The sources as the config names them, never read: the raw data need not be on a training machine.
    now = {**_settings(data, draft), "sources": [_naming(src, data.thinking) for src in data.sources]}
    try:
        tokenizer = load_tokenizer(target)
        now |= _target_part(tokenizer, resolve_template(data.chat_template, tokenizer),
                            target_vocab_size(target, tokenizer))
    except (OSError, ValueError, RuntimeError, TemplateError):
        pass  # no tokenizer with the target (a test's bare weights): its keys are not compared
    then = _config_part(then)
    skip = set(VOCAB_KEYS) if stage == "extract" else set()  # hidden states do not depend on the draft vocab
    changed = sorted(k for k in now if k not in skip and now.get(k) != then.get(k))
    if not changed:
        return
    lines = "\n".join(f"  {_CONFIG_KEYS.get(k, k)}: prepared with {_short(then.get(k))}, this config has "
                      f"{_short(now.get(k))}" for k in changed)
    raise PreparedError(f"the prepared data in {prepared_dir} was made from another config than this one:\n"
                        f"{lines}\nRe-run `eagle3 prepare --config ...` with this config before `eagle3 {stage}` "
                        "(or set the keys back).")


def _short(v: Any) -> str:
    text = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 120 else text[:117] + "..."
