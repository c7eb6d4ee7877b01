"""Weighted mixtures (`data.sources[].weight`): the trainer's per-epoch draw, prepare's summary and vocab, overlapping
sources, per-source thinking and regeneration, and what the fingerprints follow."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizer_builders import kimi_test_tokenizer, llama_test_tokenizer

from eagle3 import prepare
from eagle3.batching import Mixture, plan_batches, plan_epoch
from eagle3.config import ConfigError, load_config
from eagle3.data import prepared
from eagle3.data.prepared import load_prepared
from eagle3.logs import UserError

sys.path.append(str(Path(__file__).parent))  # tests/models.py (appended: never shadow installed packages)
from models import tiny_llama  # noqa: E402


# ----------------------------------------------------------------------------------------------- the draw
def _two_sources(seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """A small source of SHORT samples (20 x 5-15 tokens) beside a big one of LONG samples (200 x 60-140): equal
    weights then mean equal TOKENS, far from equal samples, so a draw that shares out samples is caught."""
    rng = np.random.default_rng(seed)
    lens = np.concatenate([rng.integers(5, 16, 20), rng.integers(60, 141, 200)])
    sources = ["small"] * 20 + ["big"] * 200
    order = rng.permutation(len(lens))  # interleaved, as a real split is
    return lens[order], [sources[i] for i in order]


def test_each_source_gets_its_weights_share_of_the_tokens_every_epoch():
    lens, sources = _two_sources()
    mix = Mixture.of(sources, {"small": 1.0, "big": 1.0})
    total = int(lens.sum())
    small, big = (np.flatnonzero(np.array(sources) == n) for n in ("small", "big"))
    need = total / 2
    for epoch in range(4):
        drawn = mix.draw(lens, np.random.default_rng([7, epoch]))
        got = mix.tokens(lens, drawn)
        # within the nearest sample boundary of the target
        assert abs(got["small"] - need) <= lens[small].max() / 2, (epoch, got)
        assert abs(got["big"] - need) <= lens[big].max() / 2, (epoch, got)
        counts = np.bincount(drawn, minlength=len(lens))
        k = int(need // lens[small].sum())
        assert k >= 10 and set(counts[small].tolist()) <= {k, k + 1}  # oversampled: whole passes, then a part
        assert counts[big].max() == 1 and 0.4 < (counts[big] == 1).mean() < 0.6  # undersampled: each at most once
        assert abs(sum(got.values()) - total) <= lens.max()  # an epoch keeps the split's token count
    # weights 3:1 -> 75% / 25%, again in tokens
    got = Mixture.of(sources, {"small": 3, "big": 1}).tokens(lens, Mixture.of(sources, {"small": 3, "big": 1}).draw(
        lens, np.random.default_rng(0)))
    assert abs(got["small"] / total - 0.75) < 0.01 and abs(got["big"] / total - 0.25) < 0.01


def test_the_draw_is_a_function_of_seed_and_epoch_and_the_plan_carries_it():
    lens, sources = _two_sources()
    mix = Mixture.of(sources, {"small": 2.0, "big": 1.0})
    plans = {(s, e): plan_epoch(lens, 600, s, e, mixture=mix) for s in (0, 1) for e in (0, 1, 2)}
    assert plan_epoch(lens, 600, 0, 1, mixture=mix).batches == plans[0, 1].batches  # same (seed, epoch): same plan
    drawn = {k: sorted(i for b in p.batches for i in b) for k, p in plans.items()}
    assert len({tuple(d) for d in drawn.values()}) == 6  # another epoch or seed draws other samples
    for p in plans.values():
        assert abs(p.source_tokens["small"] / sum(p.source_tokens.values()) - 2 / 3) < 0.01
        assert p.real_tokens == sum(p.source_tokens.values())  # the plan holds exactly the draw
    # data parallel: ranks split the same draw
    r0, r1 = (plan_epoch(lens, 600, 0, 0, rank=r, world_size=2, mixture=mix) for r in (0, 1))
    assert len(r0.batches) == len(r1.batches) and r0.source_tokens == r1.source_tokens == plans[0, 0].source_tokens


def _plan_before_mixtures(lengths, batch_tokens, seed, epoch, rank=0, world_size=1, bucket_batches=64):
    """plan_epoch as it was before weighted mixtures existed (exact resume compares its bytes)."""
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    bucket = max(1, int(bucket_batches * batch_tokens / max(1.0, float(lens.mean()))))
    batches = []
    for b0 in range(0, n, bucket):
        chunk = order[b0: b0 + bucket]
        batches += [chunk[b].tolist() for b in plan_batches(lens[chunk].tolist(), batch_tokens, len(chunk))]
    batches = [batches[i] for i in rng.permutation(len(batches))]
    per_rank = len(batches) // world_size if world_size > 1 else len(batches)
    return batches[rank::world_size][:per_rank]


def test_without_weights_the_plan_is_todays():
    lens, _ = _two_sources(3)
    for seed, epoch, rank, world in ((0, 0, 0, 1), (5, 3, 1, 2), (2, 1, 2, 3)):
        plan = plan_epoch(lens, 512, seed, epoch, rank, world)
        assert plan.batches == _plan_before_mixtures(lens, 512, seed, epoch, rank, world)
        assert plan.source_tokens is None


def test_the_draw_follows_the_prepared_rows_whatever_order_the_cache_keeps():
    """A cache stores samples by rank and length, not in prepared order: with `order` (each item's prepared row) it
    draws the very samples a draw over the prepared rows does, as prepare's summary predicts."""
    lens, sources = _two_sources(1)
    rows = np.random.default_rng(9).permutation(len(lens))  # cache item j holds prepared row rows[j]
    on_rows = Mixture.of(sources, {"small": 1, "big": 4}).draw(lens, np.random.default_rng([0, 0]))
    cached = Mixture.of([sources[r] for r in rows], {"small": 1, "big": 4}, order=rows).draw(
        lens[rows], np.random.default_rng([0, 0]))
    assert sorted(rows[cached].tolist()) == sorted(on_rows.tolist())


def test_a_source_without_samples_leaves_its_share_to_the_others_and_a_stray_source_is_refused():
    lens, sources = _two_sources()
    mix = Mixture.of(sources, {"small": 1, "gone": 5, "big": 1})
    got = mix.tokens(lens, mix.draw(lens, np.random.default_rng(0)))
    assert got["gone"] == 0 and abs(got["small"] - got["big"]) <= lens.max()
    with pytest.raises(Exception, match=r"source\(s\) \['big'\].*re-run `eagle3 prepare"):
        Mixture.of(sources, {"small": 1.0})


# ------------------------------------------------------------------------------------------------- config
def test_weights_are_set_on_every_source_or_none():
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight is not set but data.sources\[0\].weight is"):
        load_config(None, ["data.sources=[{path: a.jsonl, weight: 2}, {path: b.jsonl}]"])
    with pytest.raises(ConfigError, match=r"data.sources.0.weight: Input should be greater than 0"):
        load_config(None, ["data.sources=[{path: a.jsonl, weight: 0}]"])
    cfg = load_config(None, ["data.sources=[{path: a.jsonl, weight: 2, thinking: true, regenerate: true}]"])
    s = cfg.data.sources[0]
    assert (s.weight, s.thinking, s.regenerate) == (2.0, True, True)


def test_regenerate_answers_only_the_sources_that_opt_in(tmp_path: Path):
    from eagle3.regenerate import load_conversations

    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(
            {"id": f"{name}{i}", "conversations": [{"from": "human", "value": "hi"}]}) for i in range(2)))

    def ids(*flags):
        srcs = ", ".join(f"{{path: {tmp_path / n}.jsonl{', regenerate: ' + f if f else ''}}}"
                         for n, f in zip("abc", flags, strict=True))
        return [c.id for c in load_conversations(load_config(None, [f"data.sources=[{srcs}]"]).data)]

    assert ids("", "", "") == ["a0", "a1", "b0", "b1", "c0", "c1"]  # no opt-in: every source, as before
    assert ids("", "true", "") == ["b0", "b1"]
    assert ids("false", "true", "true") == ["b0", "b1", "c0", "c1"]


# ------------------------------------------------------------------------------------------------ prepare
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    llama_test_tokenizer(d, vocab_size=320)
    return d


def _jsonl(path: Path, answers: list[str], prompt: str = "q", prefix: str = "") -> Path:
    path.write_text("\n".join(json.dumps({"id": f"{prefix}{i}", "conversations": [
        {"from": "human", "value": f"{prompt} {i}"}, {"from": "gpt", "value": a}]}) for i, a in enumerate(answers)))
    return path


def _cfg(tmp_path: Path, tok_dir: Path, sources: str, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={tok_dir}", f"data.sources={sources}",
                              "data.max_length=200", "data.eval_size=0", "draft.vocab_size=12", *overrides])


def test_overlapping_sources_count_each_record_once_for_the_first(tmp_path: Path, tok_dir: Path):
    """`bundled:sharegpt-code` is a part of `bundled:sharegpt`'s file: a record two sources read (same file, split,
    record index) is kept once, for the first source, never duplicated into both splits."""
    data = _jsonl(tmp_path / "all.jsonl", [f"answer {i}" for i in range(30)])
    (tmp_path / "code.jsonl").symlink_to(data)  # another name, the same file
    sources = f"[{{path: {tmp_path / 'code.jsonl'}, max_records: 8}}, {{path: {data}}}]"
    s = prepare.run(_cfg(tmp_path, tok_dir, sources, "data.eval_size=5"))
    code, whole = s["sources"]
    assert code["yielded"] == 8 and whole["yielded"] == 22
    assert whole["skipped"] == {"duplicate_of_an_earlier_source": 8}
    p = load_prepared(_cfg(tmp_path, tok_dir, sources).prepared_dir)
    ids = list(p.train["id"]) + list(p.eval["id"])
    assert len(ids) == 30 and sorted(ids) == sorted(str(i) for i in range(30))  # no `#1` copies
    assert sum(r["samples"] for r in s["train_sources"]) == 25
    assert set(p.train["source"]) | set(p.eval["source"]) == {"code", "all"}


def test_prepare_prints_the_mixture_as_the_trainer_draws_it(tmp_path: Path, tok_dir: Path, capsys):
    small = _jsonl(tmp_path / "small.jsonl", ["zz"] * 4, prefix="s")
    big = _jsonl(tmp_path / "big.jsonl", ["abcdefg " * 6] * 40, prefix="b")
    cfg = _cfg(tmp_path, tok_dir, f"[{{path: {small}, weight: 1}}, {{path: {big}, weight: 1}}]", "train.seed=3")
    s = prepare.run(cfg)
    rows = {r["name"]: r for r in s["train_sources"]}
    p = load_prepared(cfg.prepared_dir)
    lens = [len(x) for x in p.train["input_ids"]]
    mix = Mixture.of(list(p.train["source"]), {"small": 1, "big": 1})
    want = mix.tokens(lens, mix.draw(lens, np.random.default_rng([3, 0])))  # what the trainer draws at epoch 0
    assert {n: r["epoch0_tokens"] for n, r in rows.items()} == want
    assert rows["small"]["samples"] == 4 and rows["small"]["tokens"] == sum(
        n for n, src in zip(lens, p.train["source"], strict=True) if src == "small")
    assert rows["small"]["epoch0_repeat"] > 5 > 1 > rows["big"]["epoch0_repeat"]
    assert abs(rows["small"]["epoch0_share"] - 0.5) < 0.05
    out = capsys.readouterr().out
    assert f"small: 4 samples, {rows['small']['tokens']} tokens" in out and "weight 1: " in out
    assert json.loads((cfg.prepared_dir / "meta.json").read_text())["summary"]["train_sources"] == s["train_sources"]


def test_a_weighted_vocab_keeps_the_up_weighted_small_sources_token(tmp_path: Path, tok_dir: Path):
    """The small source answers with `z`, the big one with a..g: `z` is too rare to make 12 tokens unweighted, and
    is in the vocab once the small source is weighted up (the vocab follows the epochs the head trains on)."""
    small = _jsonl(tmp_path / "small.jsonl", ["zz"] * 3, prefix="s")
    big = _jsonl(tmp_path / "big.jsonl", ["abcdefg hijk " * 4] * 40, prefix="b")
    z = ord("z")

    def vocab(name: str, *weights: float):
        w = [f", weight: {x}" for x in weights] or ["", ""]
        cfg = _cfg(tmp_path, tok_dir, f"[{{path: {small}{w[0]}}}, {{path: {big}{w[1]}}}]",
                   f"data.output_dir={tmp_path / name}")
        prepare.run(cfg)
        return load_prepared(cfg.prepared_dir)

    plain, weighted = vocab("plain"), vocab("weighted", 10, 1)
    assert not plain.t2d[z] and weighted.t2d[z]
    assert plain.t2d.sum() == weighted.t2d.sum() == 12


def test_answers_plus_prompts_counts_the_prompt_tokens(tmp_path: Path, tok_dir: Path):
    data = _jsonl(tmp_path / "d.jsonl", ["abcdefg"] * 30, prompt="QQQQQQQQQQQQQQQQ")
    q = ord("Q")
    answers = _cfg(tmp_path, tok_dir, f"[{{path: {data}}}]", f"data.output_dir={tmp_path / 'a'}")
    both = _cfg(tmp_path, tok_dir, f"[{{path: {data}}}]", f"data.output_dir={tmp_path / 'b'}",
                "draft.vocab_from=answers+prompts")
    sa, sb = prepare.run(answers), prepare.run(both)
    assert not load_prepared(answers.prepared_dir).t2d[q] and load_prepared(both.prepared_dir).t2d[q]
    assert sa["vocab_coverage"] == 1.0 >= sb["vocab_coverage"]  # coverage stays over the answers


def test_fingerprints_follow_thinking_join_parts_and_vocab_from_never_the_weights(tmp_path: Path, tok_dir: Path, caplog):
    from eagle3.cache import expected_fingerprint
    from eagle3.data.prepared import PreparedError

    target = tiny_llama(tmp_path / "target", vocab=320)
    llama_test_tokenizer(target, vocab_size=320)
    a = _jsonl(tmp_path / "a.jsonl", ["aaa"] * 6, prefix="a")
    b = _jsonl(tmp_path / "b.jsonl", ["bbb"] * 6, prefix="b")

    def cfg(wa, wb, *extra):
        return _cfg(tmp_path, target, f"[{{path: {a}, weight: {wa}}}, {{path: {b}, weight: {wb}}}]", *extra)

    first = cfg(1, 1)
    prepare.run(first)
    meta = load_prepared(first.prepared_dir).meta
    caplog.set_level(logging.WARNING, "eagle3")
    reweighted = cfg(5, 1)
    assert prepared.fingerprint(_inputs(reweighted)) == meta["fingerprint"]
    prepare.run(reweighted)  # reused, not rebuilt: same folder, same files
    assert load_prepared(first.prepared_dir).meta["created"] == meta["created"]
    assert "counted with source weights {'a': 1.0, 'b': 1.0}, this config has {'a': 5.0, 'b': 1.0}" in caplog.text
    for stage in ("extract", "train"):
        _check(reweighted, meta, stage)  # nothing to re-prepare
    assert (expected_fingerprint(reweighted.target, reweighted.extract.storage, meta)
            == expected_fingerprint(first.target, first.extract.storage, meta))  # nor to re-extract

    thinking = _cfg(tmp_path, target, f"[{{path: {a}, weight: 1, thinking: true}}, {{path: {b}, weight: 1}}]")
    assert prepared.fingerprint(_inputs(thinking)) != meta["fingerprint"]
    with pytest.raises(PreparedError, match=r"data.sources: prepared with "):
        _check(thinking, meta, "extract")
    same = _cfg(tmp_path, target, f"[{{path: {a}, weight: 1, thinking: false}}, {{path: {b}, weight: 1}}]")
    _check(same, meta, "train")  # data.thinking's own value: the rendering is the same
    joined = _cfg(tmp_path, target, f"[{{path: {a}, weight: 1, join_parts: true}}, {{path: {b}, weight: 1}}]")
    assert prepared.fingerprint(_inputs(joined)) != meta["fingerprint"]
    with pytest.raises(PreparedError, match=r"data.sources: prepared with .*this config has .*\"join_parts\": true"):
        _check(joined, meta, "extract")  # other records joined: other samples
    unjoined = _cfg(tmp_path, target, f"[{{path: {a}, weight: 1, join_parts: false}}, {{path: {b}, weight: 1}}]")
    _check(unjoined, meta, "train")  # the default, said: the same samples

    prompts = cfg(1, 1, "draft.vocab_from=answers+prompts")
    fp_in = _inputs(prompts)
    assert prepared.fingerprint(fp_in) != meta["fingerprint"]
    _check(prompts, meta, "extract")  # the states do not depend on the vocab...
    with pytest.raises(PreparedError, match="draft.vocab_from"):
        _check(prompts, meta, "train")  # ...the head does
    prepare.run(prompts)
    assert load_prepared(prompts.prepared_dir).meta["samples_fingerprint"] == meta["samples_fingerprint"]


def _inputs(cfg):
    """The fingerprint inputs `prepare` records for this config."""
    from eagle3.data.templates import load_tokenizer, resolve_template

    tok = load_tokenizer(cfg.target)
    vsize = prepared.target_vocab_size(cfg.target, tok)
    return prepared.fingerprint_inputs(cfg.data, cfg.draft, tok, resolve_template(cfg.data.chat_template, tok), vsize)


def _check(cfg, meta, stage):
    prepared.check_prepared(cfg.data, cfg.draft, cfg.target, cfg.prepared_dir, meta, stage)


def test_two_weighted_sources_with_one_name_are_refused(tmp_path: Path, tok_dir: Path):
    (tmp_path / "x").mkdir()
    a = _jsonl(tmp_path / "d.jsonl", ["a"] * 3)
    b = _jsonl(tmp_path / "x" / "d.jsonl", ["b"] * 3)
    with pytest.raises(Exception, match=rf"data.sources\[0\].path='{a}' and data.sources\[1\].path='{b}' are both "
                                        "named 'd'"):
        prepare.run(_cfg(tmp_path, tok_dir, f"[{{path: {a}, weight: 1}}, {{path: {b}, weight: 2}}]"))


def test_each_source_renders_with_its_own_thinking(tmp_path: Path):
    tok = tmp_path / "kimi"
    kimi_test_tokenizer(tok)
    for name in ("think", "plain"):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps({"messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}", "reasoning_content": f"r{i}"}]}) for i in range(3)))
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", f"target.path={tok}", "data.chat_template=kimi-k2.5",
                             f"data.sources=[{{path: {tmp_path / 'think.jsonl'}, thinking: true}}, "
                             f"{{path: {tmp_path / 'plain.jsonl'}}}]", "data.eval_size=0", "draft.vocab_size=64"])
    prepare.run(cfg)
    p = load_prepared(cfg.prepared_dir)
    for row in p.train:
        i = int(row["id"].split(":")[1])
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        reasoning = [*f"r{i}".encode(), 163607] if row["source"] == "think" else []  # data.thinking=false: no think
        assert masked == [*reasoning, *f"a{i}".encode(), 163586], row["source"]


# ------------------------------------------------------------------------------------------------ trainer
def test_the_trainer_draws_the_mixture_prepare_printed_and_resumes_it_exactly(tmp_path: Path, monkeypatch, capsys):
    """A real cache (extraction stores samples by shard and length, not in prepared order): the trainer finds each
    item's source by sample id, draws epoch 0 exactly as prepare's summary printed it, logs it, and a run killed
    after its step-4 checkpoint resumes to the same losses and the same step-6 checkpoint, byte for byte."""
    from models import checkpoint_differences, run_then_crash_after_checkpoint

    from eagle3 import trainer
    from eagle3.cache import HiddenStateDataset
    from eagle3.extract import run as extract
    from eagle3.online import OnlineSource

    target = tiny_llama(tmp_path / "target", vocab=320, hidden=64, layers=8)
    llama_test_tokenizer(target, vocab_size=320)
    small = _jsonl(tmp_path / "small.jsonl", [f"z{i}" for i in range(5)], prefix="s")
    big = _jsonl(tmp_path / "big.jsonl", ["abcdefg " * (1 + i % 4) for i in range(30)], prefix="b")

    def cfg(name: str):
        c = _cfg(tmp_path, target, f"[{{path: {small}, weight: 3}}, {{path: {big}, weight: 1}}]",
                 f"output_dir={tmp_path / name}", f"data.output_dir={tmp_path / 'prepared'}",
                 f"extract.cache_dir={tmp_path / 'cache'}", "extract.shard_samples=4", "data.eval_size=3",
                 "target.dtype=float32", "train.batch_tokens=160", "train.ttt_steps=2", "train.lr=3e-3",
                 "train.max_steps=6", "train.save_every=2", "train.eval_every=100", "train.log_every=1",
                 "train.seed=5")
        return c

    straight = cfg("straight")
    summary = prepare.run(straight)
    extract(straight)
    ds = HiddenStateDataset(tmp_path / "cache", "train")
    p = load_prepared(tmp_path / "prepared")
    source_of = dict(zip(p.train["id"], p.train["source"], strict=True))
    assert ds.sample_ids != list(p.train["id"])  # the cache keeps another order than the prepared rows
    mix = trainer.train_mixture(straight.data.sources, straight.paths, ds)
    assert [mix.names[g] for g in mix.groups] == [source_of[i] for i in ds.sample_ids]
    first = plan_epoch(ds.lengths, 160, 5, 0, mixture=mix)
    printed = {r["name"]: r["epoch0_tokens"] for r in summary["train_sources"]}
    assert first.source_tokens == printed and printed["small"] > 2 * printed["big"]
    online_split = OnlineSource(None, p.train, 0, None)  # extract.mode: online
    online = trainer.train_mixture(straight.data.sources, straight.paths, online_split)
    assert [online.names[g] for g in online.groups] == list(p.train["source"])
    assert plan_epoch([len(x) for x in p.train["input_ids"]], 160, 5, 0,
                      mixture=online).source_tokens == printed

    straight = cfg("straight")
    trainer.run(straight)
    err = capsys.readouterr().err
    assert f"epoch 0 mixture: small {printed['small']} tokens" in err and "mixture over " in err
    crashed = cfg("crashed")
    run_then_crash_after_checkpoint(monkeypatch, crashed, 4)
    trainer.run(crashed)
    state = json.loads((crashed.checkpoint_dir / "step_4" / "trainer_state.json").read_text())
    assert state["batch_index"] > 0  # the crash fell mid-epoch: the resumed run must redraw the same epoch

    def losses(name: str) -> dict[int, float]:
        rows = [json.loads(x) for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses("crashed") == losses("straight") and len(losses("straight")) == 6
    assert checkpoint_differences(straight.checkpoint_dir / "step_6", crashed.checkpoint_dir / "step_6") == []


def test_two_sources_of_one_file_must_join_parts_alike(tmp_path: Path, tok_dir: Path):
    """A joined conversation is known by its first record: a second, unjoined source of the same file would read its
    later parts again, unseen by the duplicate rule. Refused before anything is written, naming both sources."""
    data = _jsonl(tmp_path / "all.jsonl", [f"answer {i}" for i in range(6)])
    sources = f"[{{path: {data}, join_parts: true, max_records: 2}}, {{path: {data}}}]"
    with pytest.raises(UserError, match=r"data.sources\[0\] and data.sources\[1\] read the same records .*join_parts"):
        prepare.run(_cfg(tmp_path, tok_dir, sources))
    assert not (tmp_path / "run" / "prepared").exists()
