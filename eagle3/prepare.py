"""The `prepare` stage: conversations -> chat template -> input_ids + assistant-only loss_mask, and the draft vocab.

    eagle3 prepare --config configs/smollm2-135m.yaml [data.max_samples=200 data.output_dir=/tmp/prep]

Flow: load the target's tokenizer -> read every source (repairs and skips counted, see eagle3.data.sources) ->
shuffle with data.seed -> keep data.max_samples -> render each conversation (eagle3.data.templates) ->
truncate or drop over data.max_length (a sample with no loss token left is dropped) -> split train/eval ->
count the draft vocab on the train split (eagle3.data.vocab) -> write the folder described in
eagle3.data.prepared (train/, eval/, vocab.safetensors, meta.json).

Re-running with the same config reuses the folder: a sha256 fingerprint covers everything that decides the
result (source identities and a source's own `thinking`, tokenizer vocab, template text, thinking, system_prompt,
max_length, overlength, max_samples, eval_size, seed, draft.vocab_size and draft.vocab_from, eagle3.data.prepared's
PREPARE_VERSION). Source weights (`data.sources[].weight`) are not in it: the trainer draws the mixture each epoch
from the same samples, so a new weight re-prepares and re-extracts nothing; the draft vocab keeps the weights it was
counted with (a head's lm_head rows follow it). A record read by two sources (the same file, split and record
index) is kept once, for the first source that lists it. The folder is built under a
temporary name next to the target and renamed into place at the end, so a crash never leaves a folder that
`is_prepared` accepts.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle3.config import Config, DataConfig, DraftConfig, TargetConfig
from eagle3.data.images import ImageError, VisionInputs, images_identity
from eagle3.data.prepared import (
    PREPARE_VERSION,
    VOCAB_KEYS,
    PreparedError,
    fingerprint,
    fingerprint_inputs,
    is_prepared,
    prepared_images,
    read_prepared_meta,
    save_vocab,
    target_vocab_size,
)
from eagle3.data.sources import (
    SourceStats,
    read_conversations,
    record_file,
    source_name,
    source_weights,
)
from eagle3.data.templates import (
    ChatTemplate,
    TemplateError,
    check_renders_tools,
    load_tokenizer,
    render,
    resolve_template,
)
from eagle3.data.types import Conversation, turn_from_row, turn_to_row
from eagle3.data.vocab import DraftVocab, build_draft_vocab
from eagle3.fsutil import atomic_dir, current_umask, file_records
from eagle3.locks import writes
from eagle3.logs import Progress, UserError, log

MAX_TEMPLATE_ERROR_SHARE = 0.01
"""Render failures above this share of samples abort the run (a broken template, not a few odd records)."""
OUR_ENTRIES = {"train", "eval", "vocab.safetensors", "meta.json"}


# -------------------------------------------------------------------------------------------------- stages
def read_all(data: DataConfig) -> tuple[list[Conversation], list[SourceStats], dict[str, int]]:
    """Every source's conversations in order, with their reading stats, and {conversation id: index of its source in
    data.sources} (ids made unique here). A record an earlier source of the same file already yielded is skipped
    (`duplicate_of_an_earlier_source`): listed by two sources it would be trained on twice, or land in both splits."""
    convs: list[Conversation] = []
    origin: list[int] = []
    all_stats = []
    taken: dict[tuple[str, str | None], set[int]] = {}
    joined: dict[tuple[str, str | None], int] = {}
    for i, src in enumerate(data.sources):
        stats = SourceStats(source_name(src))
        t0 = time.monotonic()
        j = joined.setdefault(record_file(src), i)
        if data.sources[j].join_parts != src.join_parts:
            # A joined conversation is known by its first part's index: the others would be read again, unseen.
            raise UserError(f"data.sources[{j}] and data.sources[{i}] read the same records ({src.path}) but only one "
                            "sets join_parts: a joined conversation's later parts would be read twice; set join_parts "
                            "alike on both")
        seen = taken.setdefault(record_file(src), set())
        mine = list(read_conversations(src, stats, taken=frozenset(seen)))
        seen.update(c.record for c in mine if c.record is not None)
        convs.extend(mine)
        origin += [i] * len(mine)
        all_stats.append(stats)
        dt = time.monotonic() - t0
        log.info(f"read {src.path}: {stats.yielded} conversations from {stats.records_read} records in {dt:.1f}s"
                 + (f"; truncated tail of {stats.truncated_bytes} bytes dropped" if stats.truncated_bytes else "")
                 + (f"; {stats.skipped['duplicate_of_an_earlier_source']} records already read by an earlier source"
                    if stats.skipped["duplicate_of_an_earlier_source"] else "")
                 + (f"; {stats.parts_joined} split parts joined to the record before them" if src.join_parts else ""))
    seen_ids: Counter[str] = Counter()
    for c in convs:  # later stages key samples by id: make them unique
        seen_ids[c.id] += 1
        if seen_ids[c.id] > 1:
            c.id = f"{c.id}#{seen_ids[c.id] - 1}"
    return convs, all_stats, {c.id: i for c, i in zip(convs, origin, strict=True)}


Rendered = tuple[Conversation, list[int], list[int], str]
"""(conversation, input_ids, loss_mask, error): error is a template error's text, or SKIPPED + a skip reason ("" when
it rendered)."""
Sample = tuple[str, np.ndarray, np.ndarray, str | None, int | None, tuple[str, ...]]
"""(id, input_ids, loss_mask, source, record, images): one row of the prepared folder."""
SKIPPED = "skipped: "
"""A Rendered error that is a counted skip (an image the target cannot take), not a template failure."""


def _conv_to_row(c: Conversation) -> dict[str, Any]:
    # tools as JSON text: Arrow cannot hold free-form JSON schemas as columns
    return {"id": c.id, "turns": [turn_to_row(t) for t in c.turns],
            "tools": json.dumps(c.tools) if c.tools else "", "source": c.source, "record": c.record}


def _conv_from_row(r: dict[str, Any]) -> Conversation:
    return Conversation(r["id"], [turn_from_row(t) for t in r["turns"]], json.loads(r["tools"]) if r["tools"] else None,
                        r["source"], r["record"])


def _render_one(conv: Conversation, tokenizer: Any, tpl: ChatTemplate, thinking: bool, system_prompt: str | None,
                vision: VisionInputs | None) -> tuple[list[int], list[int], str]:
    """(ids, mask, error) of one conversation: a template error or an image skip kept as text."""
    try:
        return *render(conv, tokenizer, tpl, thinking, system_prompt, vision), ""
    except TemplateError as e:
        return [], [], str(e)
    except ImageError as e:
        return [], [], SKIPPED + e.reason


def _render_rows(batch: dict[str, list], tokenizer: Any, tpl: ChatTemplate, system_prompt: str | None,
                 vision: VisionInputs | None = None) -> dict[str, list]:
    """datasets.map worker (num_proc > 1): render a batch, keeping a template error as text instead of raising."""
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "error": []}
    for row in ({k: batch[k][i] for k in batch} for i in range(len(batch["id"]))):
        ids, mask, err = _render_one(_conv_from_row(row), tokenizer, tpl, row["thinking"], system_prompt, vision)
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["error"].append(err)
    return out


def render_all(convs: list[Conversation], d: DataConfig, tokenizer: Any, tpl: ChatTemplate,
               thinking: list[bool] | None = None, vision: VisionInputs | None = None) -> list[Rendered]:
    """(conversation, input_ids, loss_mask, error) per conversation, in order; a plain loop or
    datasets.map(num_proc). `thinking`: each conversation's setting (its source's), default `data.thinking`;
    `vision`: the target's processor, for conversations with images."""
    thinking = [d.thinking] * len(convs) if thinking is None else thinking
    if d.num_proc > 1:
        from datasets import Dataset

        ds = Dataset.from_list([_conv_to_row(c) | {"thinking": t} for c, t in zip(convs, thinking, strict=True)])
        ds = ds.map(_render_rows, batched=True, batch_size=64, num_proc=d.num_proc, remove_columns=ds.column_names,
                    fn_kwargs={"tokenizer": tokenizer, "tpl": tpl, "system_prompt": d.system_prompt, "vision": vision},
                    desc="render")
        return list(zip(convs, ds["input_ids"], ds["loss_mask"], ds["error"], strict=True))
    results = []
    tokens = 0
    with Progress(len(convs), "render", unit="conv") as bar:
        for c, think in zip(convs, thinking, strict=True):
            ids, mask, err = _render_one(c, tokenizer, tpl, think, d.system_prompt, vision)
            tokens += len(ids)
            results.append((c, ids, mask, err))
            bar.update(1, tokens=tokens)
    return results


def fit_length(rendered: list[Rendered], max_length: int, overlength: str, stats: Counter[str],
               min_length: int = 0, image_token_id: int | None = None) -> list[Sample]:
    """Drop samples shorter than min_length, apply max_length (truncate or drop) and drop samples with no
    loss-masked token; count what was lost. A cut never splits an image's tokens (the vision tower makes them all
    or none): it moves to the image's first token, and the images after it leave the sample."""
    kept = []
    for conv, ids, mask, err in rendered:
        if err.startswith(SKIPPED):
            stats[err[len(SKIPPED):]] += 1
            continue
        if err:
            stats["template_error"] += 1
            continue
        images = tuple(conv.images)
        if len(ids) < min_length:
            stats["dropped_shorter_than_min_length"] += 1
            continue
        if len(ids) > max_length:
            if overlength == "drop":
                stats["dropped_overlength"] += 1
                continue
            cut, images = image_cut(ids, images, max_length, image_token_id) if images else (max_length, images)
            stats["truncated_samples"] += 1
            stats["truncated_tokens"] += len(ids) - cut
            stats["truncated_loss_tokens"] += int(sum(mask[cut:]))
            ids, mask = ids[:cut], mask[:cut]
        m = np.asarray(mask, dtype=np.int8)
        if not m.any():
            stats["dropped_no_loss_tokens"] += 1
            continue
        kept.append((conv.id, np.asarray(ids, dtype=np.int32), m, conv.source, conv.record, images))
        if conv.has_tools:
            stats["tool_conversations"] += 1
        if images:
            stats["image_conversations"] += 1
            stats["images"] += len(images)
    return kept


def image_cut(ids: list[int], images: tuple[str, ...], max_length: int, image_token_id: int | None
              ) -> tuple[int, tuple[str, ...]]:
    """Where a sample with images is cut to max_length tokens, and the images it keeps: an image whose tokens the
    cut would split (or leave out) goes, with everything after its first token."""
    if image_token_id is None:
        raise ValueError("a sample with images needs the processor's image token id to be cut")
    arr = np.asarray(ids)
    is_img = arr == image_token_id
    starts = np.flatnonzero(is_img & ~np.concatenate([[False], is_img[:-1]]))
    ends = np.flatnonzero(is_img & ~np.concatenate([is_img[1:], [False]])) + 1
    if len(starts) != len(images):
        raise ValueError(f"{len(starts)} runs of image tokens for {len(images)} images")
    whole = int(np.sum(ends <= max_length))
    return (max_length if whole == len(images) or starts[whole] >= max_length else int(starts[whole])), images[:whole]


def eval_count(n: int, eval_size: float) -> int:
    if eval_size < 1:
        k = int(round(n * eval_size))
        return max(k, 1) if eval_size > 0 and n >= 2 else k
    return int(eval_size)


def _to_dataset(samples: list[Sample], with_images: bool = False) -> Any:
    """Build the Arrow table straight from numpy (offsets + flat values): no per-token Python objects."""
    from datasets import Dataset

    lengths = np.array([len(s[1]) for s in samples], dtype=np.int64)
    # a text-only folder keeps the columns it always had
    images = {"images": pa.array([list(s[5]) for s in samples], type=pa.list_(pa.string()))} if with_images else {}
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat_ids = np.concatenate([s[1] for s in samples]) if samples else np.zeros(0, np.int32)
    flat_mask = np.concatenate([s[2] for s in samples]) if samples else np.zeros(0, np.int8)
    table = pa.table({
        "id": pa.array([s[0] for s in samples], type=pa.string()),
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat_ids, type=pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(flat_mask, type=pa.int8())),
        # where each sample came from, for `eagle3 data show` (eagle3.data.show)
        "source": pa.array([s[3] for s in samples], type=pa.string()),
        "record": pa.array([s[4] for s in samples], type=pa.int64()),
        **images,
    })
    return Dataset(table)


def _flat(samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    if not samples:
        return np.zeros(0, np.int32), np.zeros(0, np.int8)
    return np.concatenate([s[1] for s in samples]), np.concatenate([s[2] for s in samples])


# --------------------------------------------------------------------------------------------------- output
def _check_replaceable(out: Path) -> None:
    """Refuse to delete a folder that is not ours (e.g. data.output_dir pointed at a folder with other files)."""
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"data.output_dir: {out} exists and is not a folder")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in OUR_ENTRIES)
        if foreign:
            raise FileExistsError(f"data.output_dir: {out} holds files prepare did not write ({', '.join(foreign[:5])}"
                                  f"); choose an empty or new folder")


def _open_permissions(root: Path) -> None:
    """mkdtemp makes 0700 folders: give the result the modes a plain mkdir/open would (umask applies)."""
    umask = current_umask()
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _print_summary(out: Path, s: dict[str, Any]) -> None:
    lines = [
        f"prepared data written to {out}",
        f"  sources: {s['records_read']} records read, {s['conversations']} conversations after repair, "
        f"{s['used']} used (max_samples={s['max_samples']})",
    ]
    for src in s["sources"]:
        lines.append(f"    {src['name']}: read {src['records_read']}, kept {src['yielded']}, repaired {src['repaired']}, "
                     f"skipped {src['skipped']}" + (f", truncated tail {src['truncated_bytes']} bytes"
                                                    if src["truncated_bytes"] else "")
                     + (f", malformed lines {src['malformed_lines']}" if src["malformed_lines"] else "")
                     + (f", utf8 replacements {src['utf8_replacements']}" if src["utf8_replacements"] else "")
                     + (f", split parts joined {src['parts_joined']}" if src.get("parts_joined") else ""))
    r = s["render"]
    lines.append(f"  render: template {s['chat_template']!r} thinking={s['thinking']}; {r}")
    lines.append(f"  samples: train {s['train_samples']}, eval {s['eval_samples']}; tokens train {s['train_tokens']}, "
                 f"eval {s['eval_tokens']}; loss-masked share {s['loss_share']:.3f}")
    weighted = s["vocab_weights"] is not None
    lines.append("  train split by source: samples, tokens, loss tokens" + (
        "; the mixture's epoch 0 (train.seed): tokens, share, repeat factor" if weighted else ""))
    for r in s["train_sources"]:
        line = f"    {r['name']}: {r['samples']} samples, {r['tokens']} tokens, {r['loss_tokens']} loss tokens"
        if "weight" in r:
            line += (f"; weight {r['weight']:g}: {r['epoch0_tokens']} tokens, {100 * r['epoch0_share']:.1f}%, "
                     f"x{r['epoch0_repeat']:.2f}")
        lines.append(line)
    lines.append(f"  draft vocab: {s['draft_vocab_size']} of {s['target_vocab_size']} from the {s['vocab_from']}"
                 + (" counted by the mixture's repeat factors" if weighted else "")
                 + f", coverage train {s['vocab_coverage']:.4f}, eval {s['eval_vocab_coverage']:.4f}")
    lines.append(f"  time: {s['seconds']:.1f}s ({s['conversations_per_s']:.0f} conversations/s rendered)")
    print("\n".join(lines), flush=True)


@writes(lambda cfg, **_: cfg.prepared_dir, "prepare")
def run(cfg: Config) -> dict[str, Any]:
    """Prepare (or reuse) the dataset in cfg.prepared_dir; return the summary dict (also in meta.json)."""
    t0 = time.monotonic()
    out = cfg.prepared_dir
    tokenizer = load_tokenizer(cfg.target)
    tpl = resolve_template(cfg.data.chat_template, tokenizer)
    vsize = target_vocab_size(cfg.target, tokenizer)
    fp_in = fingerprint_inputs(cfg.data, cfg.draft, tokenizer, tpl, vsize)
    fp = fingerprint(fp_in)
    weights = source_weights(cfg.data.sources)  # two weighted sources with one name: refused before any work
    reused = _reusable(out, fp, fp_in)
    if reused is not None:
        _say_weights(out, reused, weights)
        return reused
    _check_replaceable(out)

    read, eval_s, train_s = _read_and_render(cfg.data, tokenizer, tpl, cfg.target)
    if any(s[5] for s in train_s + eval_s):  # the pictures' bytes decide the samples as much as the text
        fp_in = {**fp_in, "images": images_identity([s[5] for s in train_s + eval_s])}
        fp = fingerprint(fp_in)
    train_ids, train_mask = _flat(train_s)
    eval_ids, eval_mask = _flat(eval_s)
    top = max(int(train_ids.max(initial=0)), int(eval_ids.max(initial=0)))
    if top >= vsize:
        raise ValueError(f"token id {top} is outside the target vocab ({vsize}) of target.path={cfg.target.path!r}")
    by_source = train_sources(cfg.data, cfg.train.seed, train_s)
    vocab = _count_vocab(cfg.draft, train_s, (train_ids, train_mask), vsize, by_source if weights else None)

    n_loss = int(train_mask.sum() + eval_mask.sum())
    n_tok = len(train_ids) + len(eval_ids)
    summary: dict[str, Any] = {
        **{k: read[k] for k in ("sources", "records_read", "conversations", "used")},
        "max_samples": cfg.data.max_samples,
        "chat_template": tpl.name,
        "thinking": cfg.data.thinking,
        "render": read["render"],
        "train_samples": len(train_s),
        "eval_samples": len(eval_s),
        "train_tokens": len(train_ids),
        "eval_tokens": len(eval_ids),
        "train_sources": by_source,
        "vocab_weights": weights,
        "vocab_from": cfg.draft.vocab_from,
        "loss_tokens": n_loss,
        "loss_share": n_loss / n_tok if n_tok else 0.0,
        "target_vocab_size": vsize,
        "draft_vocab_size": len(vocab.d2t),
        "vocab_coverage": vocab.coverage,
        "eval_vocab_coverage": vocab.coverage_of(eval_ids, eval_mask),
        "seconds": time.monotonic() - t0,
        "conversations_per_s": read["used"] / read["render_s"] if read["render_s"] > 0 else 0.0,
    }
    meta = _meta(cfg.data, cfg.target.path, fp, fp_in, tokenizer, tpl, vsize, vocab, summary)
    _write(out, meta, train_s, eval_s, vocab)
    _print_summary(out, summary)
    return summary


def _read_and_render(data: DataConfig, tokenizer: Any, tpl: Any, target: TargetConfig
                     ) -> tuple[dict[str, Any], list[Sample], list[Sample]]:
    """(what reading and rendering did, for the summary; eval samples; train samples): every source read, the
    conversations shuffled with data.seed, the first data.max_samples rendered and split. The target's processor is
    loaded only when a conversation has images."""
    convs, src_stats, origin = read_all(data)
    if not convs:
        raise ValueError(f"data.sources: no usable conversation in {[s.path for s in data.sources]}")
    random.Random(data.seed).shuffle(convs)
    used = convs[: data.max_samples] if data.max_samples else convs
    rstats: Counter[str] = Counter()
    thinking = [data.sources[origin[c.id]].thinking for c in used]
    thinking = [data.thinking if t is None else t for t in thinking]
    vision = VisionInputs.of(target) if any(c.images for c in used) else None
    eval_s, train_s, render_s = _render_and_split(used, data, tokenizer, tpl, rstats, thinking, vision)
    read = {"sources": [s.summary() for s in src_stats], "records_read": sum(s.records_read for s in src_stats),
            "conversations": len(convs), "used": len(used), "render": dict(sorted(rstats.items())),
            "render_s": render_s}
    return read, eval_s, train_s


def _say_weights(out: Path, reused: dict[str, Any], weights: dict[str, float] | None) -> None:
    if reused.get("vocab_weights") != weights:
        log.warning(f"the draft vocab in {out} was counted with source weights {reused.get('vocab_weights')}, this "
                    f"config has {weights}: the trainer draws the new mixture from the same samples, the vocab "
                    "stays (prepare into a new data.output_dir to count it with these weights)")


def _count_vocab(draft: DraftConfig, train_s: list[Sample], flat: tuple[np.ndarray, np.ndarray], vsize: int,
                 by_source: list[dict[str, Any]] | None) -> DraftVocab:
    """The draft vocab over the train split; in a weighted mixture (`by_source`) each sample's tokens counted by
    its source's repeat factor: the epochs the head sees."""
    token_weights = None
    if by_source is not None:
        factor = {row["name"]: row["repeat_expected"] for row in by_source}
        token_weights = np.repeat([factor[x[3]] for x in train_s], [len(x[1]) for x in train_s])
    vocab = build_draft_vocab(*flat, vsize, draft.vocab_size, token_weights,
                              with_prompts=draft.vocab_from == "answers+prompts")
    if draft.vocab_size >= vsize:
        log.info(f"draft.vocab_size={draft.vocab_size} >= target vocab {vsize}: the draft uses the full vocab")
    return vocab


def train_sources(data: DataConfig, seed: int, train_s: list[Sample]) -> list[dict[str, Any]]:
    """Per source name (config order): the train split's samples, tokens and loss tokens; with weights, the epoch-0
    mixture as the trainer draws it (eagle3.batching.Mixture with (train.seed, 0), over the prepared rows: the same
    draw as a whole cache's) in tokens, share and repeat factor, and the expected repeat factor (the draft vocab's
    weight for the source's tokens)."""
    from eagle3.batching import Mixture

    rows = {n: {"name": n, "samples": 0, "tokens": 0, "loss_tokens": 0}
            for n in dict.fromkeys(source_name(s) for s in data.sources)}
    for _, ids, mask, src, *_ in train_s:
        r = rows.setdefault(str(src), {"name": str(src), "samples": 0, "tokens": 0, "loss_tokens": 0})
        r["samples"] += 1
        r["tokens"] += len(ids)
        r["loss_tokens"] += int(mask.sum())
    weights = source_weights(data.sources)
    if weights is not None and train_s:
        lens = np.array([len(x[1]) for x in train_s], dtype=np.int64)
        mix = Mixture.of([x[3] for x in train_s], weights)
        got = mix.tokens(lens, mix.draw(lens, np.random.default_rng([seed, 0])))
        total = sum(got.values()) or 1
        for name, expected in zip(mix.names, mix.repeat_factors(lens), strict=True):
            r = rows[name]
            r.update(weight=weights[name], epoch0_tokens=got[name], epoch0_share=got[name] / total,
                     epoch0_repeat=got[name] / r["tokens"] if r["tokens"] else 0.0, repeat_expected=float(expected))
    return list(rows.values())


def _reusable(out: Path, fp: str, fp_in: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of prepared data already in `out` for this very config, else None (and why it is rebuilt)."""
    if not is_prepared(out):
        return None
    try:
        meta = read_prepared_meta(out)
    except PreparedError as e:
        log.warning(f"{e}; rebuilding")
        return None
    if "images" in meta.get("fingerprint_inputs", {}):  # the same records name the same files: are they the same?
        try:
            fp_in = {**fp_in, "images": images_identity(prepared_images(out))}
        except ImageError as e:
            log.info(f"prepared data at {out} has an image that changed ({e}); rebuilding")
            return None
        fp = fingerprint(fp_in)
    if meta.get("fingerprint") == fp:
        log.info(f"reusing prepared data at {out} (fingerprint {fp[:12]})")
        print(f"reusing prepared data at {out} (fingerprint {fp[:12]})", flush=True)
        return meta["summary"]
    old = meta.get("fingerprint_inputs", {})
    changed = sorted(k for k in set(old) | set(fp_in) if old.get(k) != fp_in.get(k))
    log.info(f"prepared data at {out} is from a different config (changed: {', '.join(changed)}); rebuilding")
    return None


def _render_and_split(used: list[Any], d: DataConfig, tokenizer: Any, tpl: Any, rstats: Counter[str],
                      thinking: list[bool] | None = None, vision: VisionInputs | None = None
                      ) -> tuple[list[Any], list[Any], float]:
    """Render the conversations with the template (`thinking`: each one's setting), fit them to data.max_length;
    (eval samples, train samples, seconds spent rendering)."""
    check_renders_tools(tokenizer, tpl, sum(c.has_tools for c in used), len(used), "conversations")
    t_render = time.monotonic()
    rendered = render_all(used, d, tokenizer, tpl, thinking, vision)
    render_s = time.monotonic() - t_render
    errors = [e for *_, e in rendered if e and not e.startswith(SKIPPED)]
    samples = fit_length(rendered, d.max_length, d.overlength, rstats, d.min_length,
                         vision.image_token_id if vision else None)
    if errors:
        log.warning(f"{len(errors)} conversations could not be rendered; first: {errors[0]}")
        if len(errors) > MAX_TEMPLATE_ERROR_SHARE * len(used):
            raise TemplateError(f"{len(errors)} of {len(used)} conversations failed to render with template "
                                f"{tpl.name!r} (more than {MAX_TEMPLATE_ERROR_SHARE:.0%}); first: {errors[0]}")
    if not samples:
        raise ValueError(f"no sample left after rendering and data.max_length={d.max_length} "
                         f"(data.overlength={d.overlength}): {dict(rstats)}")
    n_eval = eval_count(len(samples), d.eval_size)
    if n_eval >= len(samples):
        raise ValueError(f"data.eval_size={d.eval_size} leaves no training sample ({len(samples)} samples in all)")
    return samples[:n_eval], samples[n_eval:], render_s


def _meta(data: DataConfig, target_path: str, fp: str, fp_in: dict[str, Any], tokenizer: Any, tpl: Any, vsize: int,
          vocab: DraftVocab, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": PREPARE_VERSION,
        "fingerprint": fp,
        # The samples alone (draft vocab excluded): what hidden-state caches depend on, so one cache serves
        # heads with different draft vocabularies.
        "samples_fingerprint": fingerprint({k: v for k, v in fp_in.items() if k not in VOCAB_KEYS}),
        "fingerprint_inputs": fp_in,
        "target_path": target_path,
        "tokenizer": fp_in["tokenizer"] | {"name_or_path": str(getattr(tokenizer, "name_or_path", ""))},
        "chat_template": tpl.name,
        "chat_template_text": tpl.text,
        "thinking": data.thinking,
        "system_prompt": data.system_prompt,
        "max_length": data.max_length,
        "target_vocab_size": vsize,
        "draft_vocab_size": len(vocab.d2t),
        "vocab_coverage": vocab.coverage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summary,
    }


def _write(out: Path, meta: dict[str, Any], train_s: list[Any], eval_s: list[Any], vocab: DraftVocab) -> None:
    """Both splits, the draft vocab and meta.json (last: it marks the folder complete), published atomically."""
    # Prepare never runs twice at once on one folder, so leftovers of a killed run are cleared first.
    with atomic_dir(out, clear_stale=True) as tmp:
        from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

        bars = is_progress_bar_enabled()
        disable_progress_bar()  # two one-shard saves: their bars only clutter a log file
        try:
            # An empty split (data.eval_size=0) must be saved as one empty shard: with the default it gets no data
            # file at all, and load_from_disk then fails deep inside datasets (IndexError in concat_tables).
            with_images = "images" in meta["fingerprint_inputs"]  # run() added them: some sample has images
            for name, split in (("train", train_s), ("eval", eval_s)):
                _to_dataset(split, with_images).save_to_disk(str(tmp / name), num_shards=None if split else 1)
        finally:
            if bars:
                enable_progress_bar()
        save_vocab(tmp / "vocab.safetensors", vocab.d2t, vocab.t2d)
        meta = {**meta, "files": file_records(tmp)}  # every later read checks them (eagle3.data.prepared)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
        _open_permissions(tmp)
