"""Bad inputs, the cheap part (runs by default, a few seconds): fuzzed conversation files, broken configs through
the real CLI entry function, and the one-line error rule of eagle3.logs.

    pytest -q tests/reliability/test_rel_badinput_fast.py
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from eagle3.cli import main as cli_main
from eagle3.config import SourceConfig
from eagle3.data.sources import SourceStats, read_conversations
from eagle3.logs import UserError, disk_full_error, user_message

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
READ_SKIPS_OUTSIDE_RECORDS = {"malformed_json", "truncated_tail"}  # counted per line/tail, not per parsed record


def _read(path: Path, fmt: str = "auto") -> tuple[list, SourceStats]:
    stats = SourceStats("fuzz")
    return list(read_conversations(SourceConfig(path=str(path), format=fmt), stats)), stats


def _valid(convs: list, stats: SourceStats) -> None:
    """What every later stage relies on, whatever the input was."""
    for c in convs:
        roles = [t.role for t in c.turns]
        assert set(roles) <= {"system", "user", "assistant"} and "assistant" in roles, roles
        assert roles[-1] == "assistant" and all(a != b for a, b in zip(roles, roles[1:])), roles
        for t in c.turns:
            assert isinstance(t.content, str) and (t.content.strip() or (t.reasoning or "").strip())
            t.content.encode("utf-8")  # no lone surrogate: tokenizers and Arrow need real UTF-8
        assert isinstance(c.id, str)
        c.id.encode("utf-8")
    per_record = sum(v for k, v in stats.skipped.items() if k not in READ_SKIPS_OUTSIDE_RECORDS)
    assert stats.records_read == stats.yielded + per_record == len(convs) + per_record


# ------------------------------------------------------------------------------------------- fuzzed files
@FUZZ
@given(data=st.binary(max_size=400))
@example(data=b"\xbf[")  # one byte of a BOM is not a BOM: the sniffer must not strip it and call this an array
def test_arbitrary_bytes_never_crash_the_jsonl_reader(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("b") / "x.jsonl"
    p.write_bytes(data)
    _valid(*_read(p, "sharegpt"))


json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
json_any = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                                              kids, max_size=3),
                        max_leaves=8)
role = st.sampled_from(["human", "user", "gpt", "assistant", "system", "tool", "function", "", "GPT ", "bard"])
value = st.text(max_size=30) | st.sampled_from(["", "   ", "\ud800 lone", "ok \udfff"]) | json_any
turn = st.fixed_dictionaries({"from": role | json_any, "value": value})
message = st.fixed_dictionaries({"role": role, "content": value | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", None]), "text": value}), max_size=2)})
record = (st.fixed_dictionaries({"id": json_any, "conversations": st.lists(turn, max_size=6) | json_any})
          | st.fixed_dictionaries({"messages": st.lists(message, max_size=6)}) | json_any)


@FUZZ
@given(records=st.lists(record, max_size=8), as_array=st.booleans())
def test_records_of_any_shape_and_type_are_repaired_or_skipped_and_counted(tmp_path_factory, records, as_array):
    d = tmp_path_factory.mktemp("r")
    if as_array:
        p = d / "x.json"
        p.write_text(json.dumps(records))
    else:
        p = d / "x.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in records))
    _valid(*_read(p))


GOOD = [{"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(6)]


@FUZZ
@given(cut=st.integers(min_value=1, max_value=len(json.dumps(GOOD)) - 1))
def test_a_json_array_truncated_anywhere_yields_its_complete_records(tmp_path_factory, cut):
    text = json.dumps(GOOD)
    p = tmp_path_factory.mktemp("t") / "x.json"
    p.write_text(text[:cut])
    convs, stats = _read(p)
    complete = sum(1 for i in range(len(GOOD)) if len(json.dumps(GOOD[: i + 1])) - 1 <= cut)
    assert [c.id for c in convs] == [f"g{i}" for i in range(complete)]
    assert stats.truncated_bytes <= cut


def test_unreadable_json_lines_are_counted_not_fatal(tmp_path):
    lines = [json.dumps(GOOD[0]), '{"id": 1, "n": ' + "9" * 5000 + "}", "[" * 50000, '{"id": "x", "conversations"',
             json.dumps(GOOD[1])]
    p = tmp_path / "x.jsonl"
    p.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "u", "conversations": [{"from": "human", "value": '
                  b'"bad \xff\xfe bytes"}, {"from": "gpt", "value": "ok"}]}\n')
    convs, stats = _read(p)
    assert [c.id for c in convs] == ["g0", "g1", "u"]
    assert stats.skipped["malformed_json"] == 3 and stats.malformed_lines == [2, 3, 4]
    assert stats.utf8_replacements == 2 and "\ufffd" in convs[2].turns[0].content


def test_a_lone_surrogate_becomes_a_replacement_character(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "s\\ud800", "conversations": [{"from": "human", "value": "hi \\udfff"}, '
                 '{"from": "gpt", "value": "ok"}]}\n')
    (c,), stats = _read(p)
    assert c.turns[0].content == "hi \ufffd" and c.id == "s\ufffd"
    assert stats.repaired["lone_surrogate_replaced"] == 2


# ----------------------------------------------------------------------------------------------- configs
@pytest.fixture
def cfg_file(tmp_path) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text("output_dir: runs/x\ntarget:\n  num_layers: 8\ntrain:\n  lr: 1.0e-4\n")
    return p


@pytest.mark.parametrize(("overrides", "expected"), [
    (["train.lrr=3e-4"], "train.lrr: unknown key (did you mean 'train.lr'?)"),
    (["trian.lr=3e-4"], "trian: unknown key (did you mean 'train'?)"),
    (["train.lr=fast"], "train.lr: Input should be a valid number"),
    (["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (["train.max_steps=[1, 2]"], "train.max_steps: Input should be a valid integer"),
    (["data.sources=[]"], "data.sources: List should have at least 1 item"),
    (["target.aux_layer_ids=[2, 4, 9]"], "target.aux_layer_ids"),
    (["target.aux_layer_ids=[4, 2, 6]"], "three strictly increasing"),
    (["eval.num_draft_tokens=20"], "exceeds 1 + eval.topk * eval.num_steps"),
    (["eval.builtin=false"], "eval.builtin=false measures in an engine alone: set eval.engine to sglang or vllm"),
    (["regenerate.backend=openai"], "regenerate.endpoints: the openai backend needs at least one server URL"),
    (["target.backend=vllm"], "target.backend: Input should be 'hf' or 'sglang'"),
    (["train"], "expected dotted key=value"),
    (["train.lr.x=1"], "train.lr is a value, not a section"),
])
def test_bad_config_is_exit_2_with_the_dotted_path(cfg_file, capsys, overrides, expected):
    assert cli_main(["config", "show", "--config", str(cfg_file), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and expected in err, err
    assert "Traceback" not in err


def test_layer_id_beyond_the_depth_names_the_depth(cfg_file, capsys):
    assert cli_main(["config", "show", "--config", str(cfg_file), "target.aux_layer_ids=[2, 4, 9]"]) == 2
    err = capsys.readouterr().err
    assert "target.aux_layer_ids: id(s) [9] outside the target's depth; the target has 8 decoder layers" in err, err


@pytest.mark.parametrize(("text", "expected"), [
    ("train:\n  lr: 1\ntrain:\n  lr: 2\n", "duplicate key 'train'"),
    ("train: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "the top level must be a mapping"),
])
def test_broken_yaml_is_exit_2_with_the_file(tmp_path, capsys, text, expected):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    assert cli_main(["config", "show", "--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert expected in err and str(p) in err, err


def test_missing_config_file(tmp_path, capsys):
    assert cli_main(["config", "show", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ one-line error rule
def test_user_message_rules(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f.bin"))
    assert disk_full_error(full) is full
    msg = user_message(full)
    assert msg.startswith(f"disk full while writing {tmp_path / 'f.bin'}") and "MB free" in msg
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full_error(wrapped) is not None
    assert user_message(UserError("cache x does not match")) == "cache x does not match"

    from eagle3.config import SourceConfig
    from eagle3.data.prepared import PreparedError, load_prepared
    from eagle3.data.sources import resolve_source_path

    with pytest.raises(FileNotFoundError) as ours:  # raised by eagle3's own code: already phrased for the user
        resolve_source_path(SourceConfig(path=str(tmp_path / "missing.jsonl")))
    assert user_message(ours.value) == f"data.sources: {tmp_path / 'missing.jsonl'} does not exist"
    with pytest.raises(PreparedError) as named:  # a UserError
        load_prepared(tmp_path / "missing")
    assert "run `eagle3 prepare" in user_message(named.value)
    with pytest.raises(ValueError) as theirs:  # raised inside a library / Python: keeps its traceback
        int("not a number")
    assert user_message(theirs.value) is None
