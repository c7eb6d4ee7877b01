"""The prepare stage end to end (tiny tokenizer, real files), reuse/rebuild, atomic writes, and the draft vocab."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizer_builders import kimi_test_tokenizer, llama_test_tokenizer

from eagle3 import prepare
from eagle3.config import load_config
from eagle3.data.prepared import is_prepared, load_prepared
from eagle3.data.vocab import build_draft_vocab


# ----------------------------------------------------------------------------------------------- draft vocab
def test_draft_vocab_top_k_ties_by_smaller_id_sorted():
    ids = [np.array([5, 5, 5, 2, 2, 9, 9, 7, 1]), np.array([3, 9, 4])]
    masks = [np.array([1, 1, 1, 1, 1, 1, 1, 1, 0]), np.array([1, 0, 1])]
    # masked counts: 5:3, 2:2, 9:2, 7:1, 3:1, 4:1 (1 and the second 9 are not masked)
    v = build_draft_vocab(ids, masks, target_vocab_size=12, draft_vocab_size=4)
    assert v.draft_ids.tolist() == [2, 3, 5, 9]  # 5, then 2 and 9 (count 2), then 3 beats 4 and 7 (smaller id)
    assert v.d2t.dtype == torch.int64 and v.d2t.tolist() == [2, 2, 3, 6]  # target = i + d2t[i]
    assert v.t2d.dtype == torch.bool and v.t2d.nonzero().flatten().tolist() == [2, 3, 5, 9]
    assert v.coverage == pytest.approx(8 / 10)
    assert v.coverage_of(np.array([5, 7, 1]), np.array([1, 1, 0])) == pytest.approx(0.5)


def test_draft_vocab_full_when_not_smaller_and_unseen_fill_by_id():
    v = build_draft_vocab(np.array([3, 3]), np.array([1, 1]), target_vocab_size=6, draft_vocab_size=6)
    assert v.t2d.all() and (v.d2t == 0).all() and v.coverage == 1.0
    v = build_draft_vocab(np.array([4]), np.array([1]), target_vocab_size=6, draft_vocab_size=3)
    assert v.draft_ids.tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="outside the target vocab"):
        build_draft_vocab(np.array([6]), np.array([1]), target_vocab_size=6, draft_vocab_size=3)


# --------------------------------------------------------------------------------------------- end to end
def _write_data(path: Path, n: int = 40) -> None:
    recs = []
    for i in range(n):
        turns = [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                 {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " + "Indeed. " * (i % 7)}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "and twice that?"}, {"from": "gpt", "value": f"{4 * i}."}]
        recs.append({"id": f"q{i}", "conversations": turns})
    recs.append({"id": "bad", "conversations": [{"from": "human", "value": "no answer"}]})
    path.write_text("\n".join(json.dumps(r) for r in recs))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    llama_test_tokenizer(d, vocab_size=320)
    return d


def _cfg(tmp_path: Path, tok_dir: Path, *overrides: str):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        _write_data(data)
    return load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={tok_dir}",
                              f"data.sources=[{{path: {data}}}]", "data.max_length=160", "data.eval_size=0.1",
                              "draft.vocab_size=40", *overrides])


def test_prepare_end_to_end(tmp_path: Path, tok_dir: Path, capsys):
    cfg = _cfg(tmp_path, tok_dir)
    s = prepare.run(cfg)
    out = cfg.prepared_dir
    assert out == tmp_path / "run" / "prepared" and is_prepared(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["prepared"]  # no tmp folder left behind
    p = load_prepared(out)
    assert len(p.train) + len(p.eval) == 40 and len(p.eval) == 4
    assert s["train_samples"] == 36 and s["sources"][0]["skipped"] == {"no_assistant_turn": 1}
    assert p.train.features["input_ids"].feature.dtype == "int32"
    assert p.train.features["loss_mask"].feature.dtype == "int8"
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tok_dir)
    for row in p.train:
        assert len(row["input_ids"]) == len(row["loss_mask"]) <= 160 and sum(row["loss_mask"]) > 0
        text = tok.decode(row["input_ids"])
        assert text.startswith("<|im_start|>user\nquestion ")
        masked = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
        assert masked.startswith(row["id"][1:] + " plus")  # the answer, not the prompt
    # draft vocab: 40 of the 320 target ids, saved once
    assert p.d2t.shape == (40,) and p.t2d.shape == (320,) and int(p.t2d.sum()) == 40
    assert ((torch.arange(40) + p.d2t) == p.t2d.nonzero().flatten()).all()
    assert p.meta["fingerprint"] == p.fingerprint and p.meta["chat_template"] == "auto"
    assert p.meta["target_vocab_size"] == 320 and 0 < p.meta["vocab_coverage"] <= 1
    assert "prepared data written to" in capsys.readouterr().out

    # same config: reused, untouched
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert prepare.run(_cfg(tmp_path, tok_dir)) == s
    assert "reusing prepared data" in capsys.readouterr().out
    assert (out / "meta.json").stat().st_mtime_ns == mtime
    # a changed config rebuilds
    s2 = prepare.run(_cfg(tmp_path, tok_dir, "data.max_length=80"))
    assert load_prepared(out).meta["max_length"] == 80 and s2["render"]["truncated_samples"] > 0


def test_prepare_is_deterministic_and_seed_dependent(tmp_path: Path, tok_dir: Path):
    def prep(name: str, *over: str):
        cfg = _cfg(tmp_path, tok_dir, f"data.output_dir={tmp_path / name}", *over)
        prepare.run(cfg)
        return load_prepared(cfg.prepared_dir)

    a, b, c = prep("a"), prep("b"), prep("c", "data.seed=1")
    assert a.train["id"] == b.train["id"] and a.train["input_ids"] == b.train["input_ids"]
    assert torch.equal(a.d2t, b.d2t) and a.fingerprint == b.fingerprint
    assert a.eval["id"] != c.eval["id"] and a.fingerprint != c.fingerprint


def test_overlength_drop_and_truncate(tmp_path: Path, tok_dir: Path):
    t = prepare.run(_cfg(tmp_path, tok_dir, "data.max_length=100", "data.output_dir=" + str(tmp_path / "t")))
    d = prepare.run(_cfg(tmp_path, tok_dir, "data.max_length=100", "data.overlength=drop",
                         "data.output_dir=" + str(tmp_path / "d")))
    assert t["render"]["truncated_samples"] > 0 and t["render"]["truncated_tokens"] > 0
    assert d["render"]["dropped_overlength"] == t["render"]["truncated_samples"]  # the same over-long samples
    assert d["train_samples"] + d["eval_samples"] == 40 - d["render"]["dropped_overlength"]
    assert 0 < d["render"]["dropped_overlength"] < 40
    assert max(len(x) for x in load_prepared(tmp_path / "d").train["input_ids"]) <= 100
    assert max(len(x) for x in load_prepared(tmp_path / "t").train["input_ids"]) == 100


def test_min_length_keeps_only_the_long_samples(tmp_path: Path, tok_dir: Path):
    """data.min_length drops the samples shorter than it, counted; at 0 (the default) the fingerprint is the one
    folders prepared before the key existed have."""
    every = prepare.run(_cfg(tmp_path, tok_dir, "data.output_dir=" + str(tmp_path / "all")))
    lengths = sorted(len(x) for p in ("train", "eval") for x in getattr(load_prepared(tmp_path / "all"), p)["input_ids"])
    cut = lengths[len(lengths) // 2]
    long = prepare.run(_cfg(tmp_path, tok_dir, f"data.min_length={cut}", "data.output_dir=" + str(tmp_path / "long")))
    kept = load_prepared(tmp_path / "long")
    assert min(len(x) for p in ("train", "eval") for x in getattr(kept, p)["input_ids"]) >= cut
    assert long["render"]["dropped_shorter_than_min_length"] == sum(n < cut for n in lengths) > 0
    assert long["train_samples"] + long["eval_samples"] == sum(n >= cut for n in lengths)
    assert "min_length" not in load_prepared(tmp_path / "all").meta["fingerprint_inputs"]
    assert kept.fingerprint != load_prepared(tmp_path / "all").fingerprint
    assert every["train_samples"] + every["eval_samples"] == len(lengths)


def test_crash_leaves_no_prepared_folder(tmp_path: Path, tok_dir: Path, monkeypatch):
    cfg = _cfg(tmp_path, tok_dir)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare, "save_vocab", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare.run(cfg)
    assert not cfg.prepared_dir.exists()
    assert list(cfg.prepared_dir.parent.iterdir()) == []  # tmp folder removed too


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path, tok_dir: Path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="notes.txt"):
        prepare.run(_cfg(tmp_path, tok_dir, f"data.output_dir={out}"))
    assert (out / "notes.txt").read_text() == "keep me"


def test_eval_size_as_count_and_too_big(tmp_path: Path, tok_dir: Path):
    s = prepare.run(_cfg(tmp_path, tok_dir, "data.eval_size=7", "data.max_samples=20"))
    assert (s["train_samples"], s["eval_samples"]) == (13, 7)
    with pytest.raises(ValueError, match="eval_size"):
        prepare.run(_cfg(tmp_path, tok_dir, "data.eval_size=50"))


def test_kimi_thinking_messages(tmp_path: Path):
    tok_dir = tmp_path / "kimi"
    kimi_test_tokenizer(tok_dir)
    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"},
        {"role": "assistant", "content": f"a{i}", "reasoning_content": f"r{i}"}]}) for i in range(6)))
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={tok_dir}",
                             f"data.sources=[{{path: {data}}}]", "data.chat_template=kimi-k2.5", "data.thinking=true",
                             "data.eval_size=1", "draft.vocab_size=64"])
    s = prepare.run(cfg)
    p = load_prepared(cfg.prepared_dir)
    assert s["target_vocab_size"] == 163840 and p.t2d.shape == (163840,)
    assert p.t2d[163586] and p.t2d[163607]  # <|im_end|> and </think> are generated, so in the draft vocab
    row = p.train[0]
    i = int(row["id"].split(":")[1])
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert masked == [*f"r{i}".encode(), 163607, *f"a{i}".encode(), 163586]


@pytest.mark.slow
def test_prepare_real_sharegpt_smollm2(tmp_path: Path):
    cfg = load_config(Path(__file__).parent.parent / "configs" / "smollm2-135m.yaml",
                      [f"output_dir={tmp_path}", "data.max_samples=200"])
    s = prepare.run(cfg)
    p = load_prepared(cfg.prepared_dir)
    assert s["sources"][0]["truncated_bytes"] > 0  # the bundled file's broken tail was reported
    assert len(p.train) + len(p.eval) == s["train_samples"] + s["eval_samples"] > 150
    assert p.d2t.shape == (8192,) and p.t2d.shape == (49152,) and s["vocab_coverage"] > 0.8
    assert max(len(x) for x in p.train["input_ids"]) <= 1024


def test_cache_fingerprint_follows_the_samples_not_the_draft_vocab(tmp_path: Path, tok_dir: Path):
    """One hidden-state cache serves heads with different draft vocabularies; other samples need another cache."""
    from models import tiny_llama

    from eagle3.cache import expected_fingerprint

    target = tiny_llama(tmp_path / "target", vocab=320)
    llama_test_tokenizer(target, vocab_size=320)
    metas = {}
    for name, extra in {"v40": [], "v64": ["draft.vocab_size=64"], "len96": ["data.max_length=96"]}.items():
        cfg = _cfg(tmp_path, target, *extra, f"output_dir={tmp_path / name}")  # one source file for all
        prepare.run(cfg)
        metas[name] = (cfg, load_prepared(cfg.prepared_dir).meta)
    fps = {n: expected_fingerprint(c.target, c.extract.storage, m)["prepared_fingerprint"] for n, (c, m) in metas.items()}
    assert metas["v40"][1]["fingerprint"] != metas["v64"][1]["fingerprint"]  # the prepared folders differ...
    assert fps["v40"] == fps["v64"]  # ...but their samples, hence the caches they need, do not
    assert fps["len96"] != fps["v40"]


# ---------------------------------------------------------------------------------------------- damaged files
def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "flip":  # same size: only the checksum sees it
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 3, min(len(data), len(data) // 3 + 64)):
            data[i] ^= 0xA5
        path.write_bytes(bytes(data))
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("which", ["train/data-00000-of-00001.arrow", "vocab.safetensors", "eval/state.json"])
def test_a_damaged_prepared_file_is_named_and_prepare_rebuilds_it(tmp_path: Path, tok_dir: Path, how, which):
    """Every file of the prepared folder is recorded with its size and SHA-256 in meta.json: a file cut short,
    flipped in place or deleted is named on the next read, never read as data, and the same `prepare` command
    rebuilds the same samples instead of "reusing" them."""
    from eagle3.data.prepared import PreparedError

    cfg = _cfg(tmp_path, tok_dir)
    prepare.run(cfg)
    out = cfg.prepared_dir
    before = load_prepared(out)
    rows = (before.train.to_dict(), before.eval.to_dict())
    _damage(out / which, how)
    want = {"truncate": "bytes where", "flip": "SHA-256 differs", "delete": "missing"}[how]
    named = rf"the prepared data in {out} is damaged: {which}: .*{want}.*re-run "
    if how == "delete" and "/" not in which:  # one of the folder's four entries gone: not a prepared folder at all
        named = rf"no prepared data in {out} \(train/, eval/, vocab.safetensors and meta.json\): run `eagle3 prepare"
    with pytest.raises(PreparedError, match=named):
        load_prepared(out)
    prepare.run(cfg)
    after = load_prepared(out)
    assert (after.train.to_dict(), after.eval.to_dict()) == rows and torch.equal(after.d2t, before.d2t)


def test_samples_seen_in_counts_what_another_split_held_out(tmp_path: Path, tok_dir: Path):
    """A split is held out from its own config's training only: another seed draws another split, and its training
    split holds every sample of ours it did not hold out. Counted token for token."""
    from eagle3.data.prepared import samples_seen_in

    def prep(name: str, *over: str):
        cfg = _cfg(tmp_path, tok_dir, f"data.output_dir={tmp_path / name}", *over)
        prepare.run(cfg)
        return cfg.prepared_dir

    a, c = load_prepared(prep("a")), load_prepared(prep("c", "data.seed=1"))
    assert samples_seen_in(a.eval, a.train) == 0
    assert samples_seen_in(a.eval, a.eval) == len(a.eval) == 4
    held_out_by_both = len(set(a.eval["id"]) & set(c.eval["id"]))
    assert held_out_by_both < len(a.eval)  # the seeds drew other splits
    assert samples_seen_in(a.eval, c.train) == len(a.eval) - held_out_by_both
