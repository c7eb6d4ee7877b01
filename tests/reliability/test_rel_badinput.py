"""Bad inputs across the pipeline: messy conversation files through `eagle3 prepare`, a draft vocab larger than
the target's, NaN/inf hidden states, a cache from another target or other layer ids, a checkpoint from another
config. Each gets a clear error naming the file/record/field (exit 1, one `error:` line, no library traceback)
or a stated repair.

    pytest -q -m slow tests/reliability/test_rel_badinput.py
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from rel_world import (
    CLI,
    TRAIN,
    error_block,
    no_traceback,
    run_cmd,
    shared_world,
    write_cfg,
    write_jsonl,
)

from eagle3.cache import CacheError
from eagle3.config import load_config
from eagle3.logs import user_message

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny world, prepared and extracted once (in process)."""
    return shared_world(tmp_path_factory.mktemp("bad"))


@pytest.fixture
def eagle3_log():
    """Everything the `eagle3` logger says during the test (its own stderr handler predates pytest's capture)."""
    import logging

    class ListHandler(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

        def text(self) -> str:
            return "\n".join(self.lines)

    h = ListHandler()
    logger = logging.getLogger("eagle3")
    logger.addHandler(h)
    yield h
    logger.removeHandler(h)


def _copy(cfgd: dict, **top) -> dict:
    out = json.loads(json.dumps(cfgd))
    out.update(top)
    return out


# ------------------------------------------------------------------------------------------------- prepare
def test_messy_source_is_repaired_or_skipped_and_counted_by_the_cli(world, tmp_path):
    good = [{"id": f"g{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(8)]
    lines = [json.dumps(r) for r in good[:4]]
    lines += [
        '{"id": "broken", "conversations": [',                                          # malformed JSON
        json.dumps({"id": "types", "conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x"}]}),
        json.dumps({"id": "empty", "conversations": []}),                               # nothing to learn
        json.dumps({"id": "blank", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": ""}]}),
        json.dumps({"id": "tool", "conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "r"},
                                                    {"from": "gpt", "value": "a"}]}),
        json.dumps({"id": "huge-q", "conversations": [{"from": "human", "value": "why? " * 100_000},
                                                      {"from": "gpt", "value": "because"}]}),  # 500 KB prompt
        json.dumps({"id": "huge-a", "conversations": [{"from": "human", "value": "why?"},
                                                      {"from": "gpt", "value": "because " * 60_000}]}),
        json.dumps({"id": "surrogate", "conversations": [{"from": "human", "value": "hi \ud800"},
                                                         {"from": "gpt", "value": "ok"}]}),
        json.dumps(["not", "a", "record"]),
        "",
    ]
    lines += [json.dumps(r) for r in good[4:]]
    raw = "\n".join(lines).encode() + b"\n"
    raw += b'{"id": "bytes", "conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}\n'
    raw += b'{"id": "torn", "conversations": [{"from": "hu'                           # a torn last line
    src = tmp_path / "messy.jsonl"
    src.write_bytes(raw)

    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["data"] = {**cfgd["data"], "sources": [{"path": str(src)}], "output_dir": None, "eval_size": 0.0}
    r = run_cmd([*CLI, "prepare", "--config", str(write_cfg(tmp_path / "cfg.yaml", cfgd))])
    assert r.returncode == 0 and no_traceback(r.stderr), r.stderr[-3000:]
    assert "prepared data written to" in r.stdout
    meta = json.loads((tmp_path / "run" / "prepared" / "meta.json").read_text())
    s = meta["summary"]["sources"][0]
    assert s["skipped"] == {"malformed_json": 2, "no_assistant_turn": 2, "non_string_value": 1,
                            "not_a_conversation": 1, "tool_result_without_call": 1}, s
    assert s["malformed_lines"] == [5, 20] and s["utf8_replacements"] == 1
    assert s["repaired"] == {"lone_surrogate_replaced": 1}
    # Both huge messages are cut at data.max_length; the huge prompt leaves no answer token, so it is dropped.
    render = meta["summary"]["render"]
    assert render["truncated_samples"] == 2 and render["dropped_no_loss_tokens"] == 1, render
    from eagle3.data.prepared import load_prepared

    ids = set(load_prepared(tmp_path / "run" / "prepared").train["id"])
    assert ids == {f"g{i}" for i in range(8)} | {"huge-a", "surrogate", "bytes"}


def test_a_source_with_nothing_usable_is_one_line_naming_it(world, tmp_path):
    src = write_jsonl(tmp_path / "useless.jsonl", [{"id": 1, "conversations": [{"from": "human", "value": "?"}]},
                                                   {"foo": "bar"}, 17])
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["data"] = {**cfgd["data"], "sources": [{"path": str(src)}], "output_dir": None}
    r = run_cmd([*CLI, "prepare", "--config", str(write_cfg(tmp_path / "cfg.yaml", cfgd))])
    assert r.returncode == 1 and no_traceback(r.stderr), r.stderr[-3000:]
    block = error_block(r.stderr)
    assert "data.sources: no usable conversation" in block and str(src) in block
    assert not (tmp_path / "run" / "prepared").exists()


@pytest.mark.parametrize("kind", ["missing", "binary", "folder-without-dataset"])
def test_unreadable_sources_name_the_path(world, tmp_path, kind):
    from eagle3.prepare import run as prepare

    src = tmp_path / "src"
    if kind == "binary":
        src.write_bytes(b"\x00\x01PK\x03\x04 not json")
    elif kind == "folder-without-dataset":
        src.mkdir()
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["data"] = {**cfgd["data"], "sources": [{"path": str(src)}], "output_dir": None}
    with pytest.raises(Exception) as e:
        prepare(load_config(write_cfg(tmp_path / "cfg.yaml", cfgd)))
    msg = user_message(e.value)  # what the CLI prints as its one `error:` line (None = a library traceback)
    assert msg is not None and str(src) in msg, repr(e.value)


def test_draft_vocab_larger_than_the_target_vocab_is_the_full_vocab(world, tmp_path, eagle3_log):
    """Stated repair (eagle3.data.vocab): draft.vocab_size >= target vocab means the full target vocab."""
    from eagle3.data.prepared import load_prepared
    from eagle3.prepare import run as prepare

    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["data"] = {**cfgd["data"], "output_dir": None}
    cfgd["draft"] = {"vocab_size": 100_000}
    s = prepare(load_config(write_cfg(tmp_path / "cfg.yaml", cfgd)))
    p = load_prepared(tmp_path / "run" / "prepared")
    assert s["draft_vocab_size"] == 320 and p.d2t.tolist() == [0] * 320 and bool(p.t2d.all())
    assert "draft.vocab_size=100000 >= target vocab 320: the draft uses the full vocab" in eagle3_log.text()


# ------------------------------------------------------------------------------------------ NaN / inf states
@pytest.fixture(scope="module")
def nan_target(world, tmp_path_factory):
    """The world's target with one token's embedding row set to NaN: every sample holding that token gets NaN
    states (from that position on), the others stay finite. Returns (folder, ids of the affected samples)."""
    from safetensors.torch import load_file, save_file

    from eagle3.data.prepared import load_prepared

    target = tmp_path_factory.mktemp("nan") / "target"
    shutil.copytree(world["target"], target)
    prepared = load_prepared(world["prepared"])
    has = Counter(t for split in (prepared.train, prepared.eval) for ids in split["input_ids"] for t in set(ids))
    token = min((t for t, n in has.items() if n >= 2), key=lambda t: (has[t], t))  # rare but present
    bad = {sid for split in (prepared.train, prepared.eval) for sid, ids in zip(split["id"], split["input_ids"])
           if token in ids}
    w = load_file(str(target / "model.safetensors"))
    w["model.embed_tokens.weight"][token] = float("nan")
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target, bad


def test_nan_states_are_skipped_counted_and_never_trained_on(world, nan_target, tmp_path, capsys, eagle3_log):
    """Offline: extraction skips exactly the samples with NaN/inf states, says so, counts them in the manifest
    and `cache info`; training sees only finite states and its losses stay finite."""
    from eagle3.cache import HiddenStateDataset, print_info, summary
    from eagle3.extract import run as extract
    from eagle3.trainer import run as train

    target, bad = nan_target
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["target"] = {**cfgd["target"], "path": str(target)}
    cfgd["extract"] = {**cfgd["extract"], "cache_dir": str(tmp_path / "cache")}
    cfg = load_config(write_cfg(tmp_path / "cfg.yaml", cfgd))
    out = extract(cfg)
    err = eagle3_log.text()
    assert out["skipped_nonfinite"] == len(bad) > 0
    for sid in bad:
        assert f"sample {sid!r}: the target returned NaN/inf hidden states; skipped" in err
    assert f"{len(bad)} of 60 samples skipped" in err
    s = summary(cfg.cache_dir)["splits"]
    assert s["train"]["skipped_nonfinite"] + s["eval"]["skipped_nonfinite"] == len(bad)
    print_info(cfg.cache_dir)
    assert "samples skipped (non-finite states)" in capsys.readouterr().out
    for split in ("train", "eval"):
        ds = HiddenStateDataset(cfg.cache_dir, split)
        for i in range(len(ds)):
            item = ds[i]
            assert item["sample_id"] not in bad
            assert torch.isfinite(item["aux"]).all() and torch.isfinite(item["final"]).all()
    assert len(HiddenStateDataset(cfg.cache_dir, "train")) + len(HiddenStateDataset(cfg.cache_dir, "eval")) == \
        60 - len(bad)
    cfg.train.max_steps, cfg.train.eval_every = 3, 3
    m = train(cfg)
    assert torch.isfinite(torch.tensor(m["loss"]))
    assert all(torch.isfinite(torch.tensor(float(v))) for v in m["eval"].values()), m["eval"]


def test_online_nan_samples_are_blanked_never_trained_on(world, tmp_path, monkeypatch, eagle3_log):
    """Online mode: a sample whose states come back NaN/inf stays in its planned batch as a blank (zero states, no
    loss positions), is logged by id, and the step's loss, gradient and metrics stay finite.

    The NaN is injected after the real target's forward (a NaN embedding row would also poison the draft, which
    shares the target's embeddings), as an fp16 overflow deep in the target would produce it."""
    import eagle3.targets as hf
    from eagle3.data.prepared import load_prepared
    from eagle3.targets.base import Captured
    from eagle3.trainer import run as train

    prepared = load_prepared(world["prepared"])
    poisoned = {tuple(prepared.train[i]["input_ids"]): prepared.train[i]["id"] for i in (0, 7, 13)}
    poisoned[tuple(prepared.eval[1]["input_ids"])] = prepared.eval[1]["id"]
    real = hf.make_backend

    class NaNFor:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def capture(self, batch):
            out = []
            for ids, c in zip(batch, self.backend.capture(batch)):
                if tuple(ids) in poisoned:
                    aux = c.aux.clone()
                    aux[len(ids) // 2] = float("inf")
                    c = Captured(aux=aux, final=c.final.clone().fill_(float("nan")))
                out.append(c)
            return out

    monkeypatch.setattr(hf, "make_backend", lambda *a, **kw: NaNFor(real(*a, **kw)))
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["extract"] = {**cfgd["extract"], "mode": "online", "cache_dir": str(tmp_path / "no-cache")}
    cfgd["train"] = {**cfgd["train"], "batch_tokens": 8000, "max_steps": 2, "eval_every": 2}  # one batch: all
    m = train(load_config(write_cfg(tmp_path / "cfg.yaml", cfgd)))
    assert torch.isfinite(torch.tensor(m["loss"])) and m["loss"] > 0
    assert torch.isfinite(torch.tensor(m["grad_norm"])) and m["grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(float(v))) for v in m["eval"].values()), m["eval"]
    for sid in poisoned.values():
        assert f"online: sample {sid!r}: the target returned NaN/inf hidden states; blanked" in eagle3_log.text()
    assert not (tmp_path / "no-cache").exists()


# ------------------------------------------------------------------------------- caches from another job
def test_a_cache_from_another_target_is_refused_by_the_cli(world, tmp_path):
    from models import tiny_llama
    from tokenizer_builders import llama_test_tokenizer

    other = tiny_llama(tmp_path / "other", vocab=320, hidden=64, layers=8, seed=1)  # same shapes, other weights
    llama_test_tokenizer(other, vocab_size=320)
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["target"] = {**cfgd["target"], "path": str(other)}
    r = run_cmd([*TRAIN, "--config", str(write_cfg(tmp_path / "cfg.yaml", cfgd))])
    assert r.returncode == 1 and no_traceback(r.stderr), r.stderr[-3000:]
    block = error_block(r.stderr)
    assert f"hidden-state cache {world['cache']} does not match the config" in block
    assert "target path" in block and "target weights id" in block
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_new_weights_in_the_same_folder_are_refused(world, tmp_path):
    """Same path, same file names and sizes (a fine-tune or a re-download): only the values differ."""
    from models import tiny_llama

    from eagle3.cache import expected_fingerprint
    from eagle3.trainer import run as train

    target = tmp_path / "target"
    shutil.copytree(world["target"], target)
    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["target"] = {**cfgd["target"], "path": str(target)}
    cfgd["extract"] = {**cfgd["extract"], "cache_dir": str(tmp_path / "cache"), "max_samples": 4}
    cfg = load_config(write_cfg(tmp_path / "cfg.yaml", cfgd))
    before = expected_fingerprint(cfg.target, cfg.extract.storage, cfg.prepared_dir)
    from eagle3.extract import run as extract

    extract(cfg)
    size = (target / "model.safetensors").stat().st_size
    tiny_llama(tmp_path / "tuned", vocab=320, hidden=64, layers=8, seed=5)
    shutil.copy(tmp_path / "tuned" / "model.safetensors", target / "model.safetensors")
    assert (target / "model.safetensors").stat().st_size == size
    assert expected_fingerprint(cfg.target, cfg.extract.storage, cfg.prepared_dir)["weights_id"] != before["weights_id"]
    with pytest.raises(CacheError, match="target weights id") as e:
        train(cfg)
    assert user_message(e.value) is not None


def test_a_cache_with_other_layer_ids_is_refused(world, tmp_path):
    from eagle3.trainer import run as train

    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["target"] = {**cfgd["target"], "aux_layer_ids": [1, 3, 6]}
    with pytest.raises(CacheError, match=r"layer ids \[2, 4, 5\] but the config asks for \[1, 3, 6\]"):
        train(load_config(write_cfg(tmp_path / "cfg.yaml", cfgd)))


# ----------------------------------------------------------------------------- checkpoints from another job
@pytest.fixture
def trained(world, tmp_path):
    from eagle3.trainer import run as train

    cfgd = _copy(world["cfgd"], output_dir=str(tmp_path / "run"))
    cfgd["train"] = {**cfgd["train"], "max_steps": 2, "save_every": 2, "eval_every": 100}
    train(load_config(write_cfg(tmp_path / "cfg.yaml", cfgd)))
    return cfgd


def test_resume_with_another_draft_vocab_is_refused(world, trained, tmp_path):
    from eagle3.data.prepared import save_vocab
    from eagle3.fsutil import file_records
    from eagle3.trainer import run as train

    prepared = tmp_path / "prepared-other-vocab"  # same prepared data and fingerprint, another d2t
    shutil.copytree(world["prepared"], prepared)
    d2t = torch.zeros(64, dtype=torch.int64)
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[:64] = True
    save_vocab(prepared / "vocab.safetensors", d2t, t2d)
    meta = json.loads((prepared / "meta.json").read_text())  # recorded as a prepare run would have
    meta["files"] = file_records(prepared, skip=("meta.json",))
    (prepared / "meta.json").write_text(json.dumps(meta))
    cfgd = _copy(trained)
    cfgd["data"] = {**cfgd["data"], "output_dir": str(prepared)}
    cfgd["train"] = {**cfgd["train"], "max_steps": 4}
    with pytest.raises(ValueError, match="was trained with another draft vocab") as e:
        train(load_config(write_cfg(tmp_path / "cfg2.yaml", cfgd)))
    assert "train.resume=false" in user_message(e.value)


def test_resume_with_other_draft_dims_is_a_clear_error(trained, tmp_path):
    from eagle3.trainer import run as train

    cfgd = _copy(trained)
    cfgd["draft"] = {**cfgd["draft"], "intermediate_size": 256}
    cfgd["train"] = {**cfgd["train"], "max_steps": 4}
    with pytest.raises(Exception) as e:
        train(load_config(write_cfg(tmp_path / "cfg2.yaml", cfgd)))
    msg = user_message(e.value)
    assert msg is not None and "intermediate_size" in msg and "checkpoint" in msg
