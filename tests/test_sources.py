"""Reading conversations: formats, repair rules and their counts, truncated files, malformed lines, HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.config import SourceConfig
from eagle3.data.sources import SourceStats, read_conversations, sniff_format
from eagle3.data.types import Turn


def _read(path: Path, **kw) -> tuple[list, SourceStats]:
    stats = SourceStats(path.name)
    convs = list(read_conversations(SourceConfig(path=str(path), **kw), stats))
    return convs, stats


def _sg(*turns: tuple[str, object], id: str | None = "r") -> dict:
    rec: dict = {} if id is None else {"id": id}
    rec["conversations"] = [{"from": f, "value": v} for f, v in turns]
    return rec


def test_sharegpt_repair_rules_each_counted(tmp_path: Path):
    records = [
        _sg(("human", "hi"), ("gpt", "hello"), id="ok"),
        _sg(("gpt", "leading"), ("human", "q"), ("gpt", "a"), id="lead"),
        _sg(("human", "q1"), ("human", "q2"), ("gpt", "a1"), ("chatgpt", "a2"), id="merge"),
        _sg(("human", "q"), ("gpt", "   "), ("human", "q2"), ("bard", "a"), id="empty"),
        _sg(("human", "q"), ("gpt", "a"), ("human", "dangling"), id="trail"),
        _sg(("system", "be nice"), ("user", "q"), ("model", "a"), id="sys"),
        _sg(("human", "q"), ("narrator", "x"), ("gpt", "a"), id="unknown"),
        _sg(("human", "q"), ("gpt", 42), id="nonstr"),
        _sg(("human", "only a question"), id="noanswer"),
        _sg(("human", "q"), ("gpt", "a"), id=None),
        "not an object",
    ]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records, indent=1))
    convs, st = _read(path)

    by_id = {c.id: c.turns for c in convs}
    assert by_id["ok"] == [Turn("user", "hi"), Turn("assistant", "hello")]
    assert by_id["lead"] == [Turn("user", "q"), Turn("assistant", "a")]
    assert by_id["merge"] == [Turn("user", "q1\n\nq2"), Turn("assistant", "a1\n\na2")]
    # removing the empty answer makes two user turns adjacent: they merge
    assert by_id["empty"] == [Turn("user", "q\n\nq2"), Turn("assistant", "a")]
    assert by_id["trail"] == [Turn("user", "q"), Turn("assistant", "a")]
    assert by_id["sys"] == [Turn("system", "be nice"), Turn("user", "q"), Turn("assistant", "a")]
    assert by_id["data:9"] == [Turn("user", "q"), Turn("assistant", "a")]  # generated: <source name>:<index>
    assert sorted(by_id) == sorted(["ok", "lead", "merge", "empty", "trail", "sys", "data:9"])

    assert st.records_read == 11 and st.yielded == 7
    assert st.repaired == {"leading_assistant_dropped": 1, "same_role_merged": 2, "empty_turn_removed": 1,
                           "trailing_user_dropped": 1, "generated_id": 1}
    assert st.skipped == {"unknown_role": 1, "non_string_value": 1, "no_assistant_turn": 1, "not_a_conversation": 1}
    assert st.truncated_bytes == 0


def test_truncated_json_array_recovers_complete_records(tmp_path: Path):
    records = [_sg(("human", f"question {i} " + "x" * 300), ("gpt", f"answer {i}"), id=f"id{i}") for i in range(50)]
    text = json.dumps(records, indent=2)
    cut = text.index('"id": "id37"') + 5  # in the middle of record 37
    path = tmp_path / "trunc.json"
    path.write_text(text[:cut])
    stats = SourceStats("trunc")
    # small chunks: exercises refills and records spanning chunk boundaries
    from eagle3.data import readers, sources

    convs = [sources._to_conversation(r, i, "trunc", None, stats) for i, r in readers.iter_json_array(path, stats, 512)]
    assert [c.id for c in convs] == [f"id{i}" for i in range(37)]
    tail = text[text.rindex("\n  {", 0, cut) + 3 : cut]  # from the opening brace of record 37
    assert stats.truncated_bytes == len(tail.encode())
    assert stats.skipped["truncated_tail"] == 1

    convs2, st2 = _read(path)  # the public path agrees
    assert len(convs2) == 37 and st2.truncated_bytes == stats.truncated_bytes


def test_truncated_copy_of_real_sharegpt_head(tmp_path: Path):
    """The bundled file itself ends mid-record; a 300 KB head of it must behave the same way."""
    from eagle3.bundled import sharegpt_path

    head = sharegpt_path().open("rb").read(300_000)
    path = tmp_path / "head.json"
    path.write_bytes(head)
    text = head.decode("utf-8", errors="ignore")
    boundary = text.rindex("\n  },\n  {")  # the last complete record ends here
    expected = json.loads(text[: boundary + 4] + "]")
    convs, st = _read(path)
    assert st.records_read == len(expected) > 10
    assert st.truncated_bytes > 0 and st.skipped["truncated_tail"] == 1
    assert convs[0].id == expected[0]["id"]
    assert st.yielded + sum(v for k, v in st.skipped.items() if k != "truncated_tail") == len(expected)


def test_real_sharegpt_max_records_is_lazy():
    stats = SourceStats("sharegpt")
    convs = list(read_conversations(SourceConfig(path="bundled:sharegpt", max_records=5), stats))
    assert len(convs) == 5 and stats.stopped_early
    assert stats.records_read < 20  # stopped right away, not after reading 125 MB
    assert stats.truncated_bytes == 0  # never reached the tail


def test_jsonl_malformed_lines_and_invalid_utf8(tmp_path: Path):
    good = json.dumps(_sg(("human", "q"), ("gpt", "a"), id="g")).encode()
    bad_utf8 = json.dumps(_sg(("human", "caf\u00e9"), ("gpt", "a"), id="u"), ensure_ascii=False).encode().replace(b"\xc3\xa9", b"\xff")
    lines = [good, b"{not json", b"", good.replace(b'"g"', b'"h"'), b"[1, 2", bad_utf8]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    convs, st = _read(path)
    assert [c.id for c in convs] == ["g", "h", "u"]
    assert st.skipped["malformed_json"] == 2
    assert st.malformed_lines == [2, 5]
    assert st.utf8_replacements == 1
    assert convs[2].turns[0].content == "caf\ufffd"


def test_messages_format_parts_and_reasoning(tmp_path: Path):
    recs = [
        {"id": "m1", "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": "hi", "reasoning_content": "think"},
        ]},
        # an audio part: no target eagle3 serves takes it (images are read: tests/test_images.py)
        {"id": "m2", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
                                  {"role": "assistant", "content": "a"}]},
        {"id": "m3", "messages": [{"role": "user", "content": "q"}, {"role": "narrator", "content": "t"},
                                  {"role": "assistant", "content": "a"}]},
        {"id": "m4", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
                                  {"role": "assistant", "content": "a"}]},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    convs, st = _read(path)
    assert [c.id for c in convs] == ["m1", "m4"]
    assert convs[0].turns == [Turn("system", "sys"), Turn("user", "hello"), Turn("assistant", "hi", "think")]
    assert convs[1].turns == [Turn("user", "q"), Turn("assistant", "a")]  # null content = empty, removed
    assert st.skipped == {"non_text_part": 1, "unknown_role": 1}


def test_sniffing(tmp_path: Path):
    (tmp_path / "a.json").write_text('  \n[{"x": 1}]')
    (tmp_path / "b.json").write_text('{"x": 1}\n{"x": 2}\n')
    (tmp_path / "c.jsonl").write_text("")
    (tmp_path / "d.txt").write_text("hello")
    assert sniff_format(tmp_path / "a.json") == "json"
    assert sniff_format(tmp_path / "b.json") == "jsonl"
    assert sniff_format(tmp_path / "c.jsonl") == "jsonl"
    assert sniff_format(tmp_path) == "hf"
    with pytest.raises(ValueError, match="d.txt"):
        sniff_format(tmp_path / "d.txt")


def test_hf_folders_dataset_and_dict(tmp_path: Path):
    from datasets import Dataset, DatasetDict

    rows = [_sg(("human", "q"), ("gpt", "a"), id="s0"), _sg(("human", "q2"), ("gpt", "a2"), id="s1")]
    msg_rows = [{"id": "t0", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(msg_rows)}).save_to_disk(
        str(tmp_path / "dd"))

    convs, _ = _read(tmp_path / "ds")
    assert [c.id for c in convs] == ["s0", "s1"]
    convs, _ = _read(tmp_path / "dd", split="test")
    assert [c.id for c in convs] == ["t0"] and convs[0].turns[1] == Turn("assistant", "a")
    with pytest.raises(ValueError, match="set split"):
        _read(tmp_path / "dd")
    with pytest.raises(ValueError, match="no split 'nope'"):
        _read(tmp_path / "dd", split="nope")


def test_missing_file_names_the_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        _read(tmp_path / "nope.json")


def test_sharegpt_reasoning_written_by_regenerate_is_read(tmp_path: Path):
    rec = {"id": "g", "conversations": [{"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a", "reasoning": "because"}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    convs, _ = _read(path)
    assert convs[0].turns == [Turn("user", "q"), Turn("assistant", "a", "because")]


def test_bundled_sharegpt_code_keeps_the_conversations_with_code():
    from eagle3.data.sources import has_code

    code_stats, all_stats = SourceStats("code"), SourceStats("all")
    code = list(read_conversations(SourceConfig(path="bundled:sharegpt-code"), code_stats))
    every = list(read_conversations(SourceConfig(path="bundled:sharegpt"), all_stats))
    assert [c.id for c in code] == [c.id for c in every if has_code(c)] and len(code) == 5966
    assert code_stats.skipped["no_code_block"] == len(every) - len(code)
    assert all(any("```" in t.content for t in c.turns if t.role == "assistant") for c in code[:50])


def test_join_parts_joins_a_split_conversation_where_its_parts_meet(tmp_path: Path):
    """ShareGPT V3 stores a long conversation as consecutive records `<id>_<k>` (k: its first message's index). A
    part that starts with an answer repeats the previous part's last message; a part the cleaning dropped leaves a
    gap. Parts join where they meet or overlap with equal messages, never across a gap or an unequal overlap."""
    records = [
        _sg(("human", "q0"), ("gpt", "a0"), id="A_0"),
        _sg(("human", "q1"), ("gpt", "a1 part"), id="A_2"),  # meets: messages 2-3
        _sg(("gpt", "a1 part"), ("human", "q2"), ("gpt", "a2"), id="A_3"),  # overlaps by one equal message
        _sg(("human", "q4"), ("gpt", "a4"), id="A_8"),  # a gap (messages 6-7 dropped): a conversation of its own
        _sg(("human", "x"), ("gpt", "y"), id="B_0"),
        _sg(("gpt", "not y"), ("human", "x2"), ("gpt", "y2"), id="B_1"),  # overlap, but unequal: kept apart
        _sg(("human", "lone"), ("gpt", "one"), id="plain"),
        _sg(("human", "q"), ("gpt", "a"), id="C_0"),  # another conversation's part right after
        _sg(("human", "q'"), ("gpt", "a'"), id="A_10"),  # A again, but not consecutive: apart
    ]
    path = tmp_path / "split.json"
    path.write_text(json.dumps(records))
    convs, stats = _read(path, join_parts=True)
    got = {c.id: [t.content for t in c.turns] for c in convs}
    assert got == {"A_0": ["q0", "a0", "q1", "a1 part", "q2", "a2"], "A_8": ["q4", "a4"], "B_0": ["x", "y"],
                   "B_1": ["x2", "y2"], "plain": ["lone", "one"], "C_0": ["q", "a"], "A_10": ["q'", "a'"]}
    assert stats.parts_joined == 2 and stats.summary()["parts_joined"] == 2
    assert [c.record for c in convs] == [0, 3, 4, 5, 6, 7, 8]  # a joined conversation is its first record
    assert stats.repaired == {"leading_assistant_dropped": 1}  # B_1's answer before any question, as always
    plain, _ = _read(path)  # without the option every record stays a conversation
    assert len(plain) == len(records)


def test_join_parts_on_the_bundled_sharegpt_gives_long_conversations():
    """The bundled file's 17,390 records are 9,435 conversations joined back, 644 of them >= 32K characters (split
    at ~2K LLaMA tokens, only 11 records are)."""
    stats = SourceStats("joined")
    joined = list(read_conversations(SourceConfig(path="bundled:sharegpt", join_parts=True), stats))
    chars = [sum(len(t.content) for t in c.turns) for c in joined]
    assert len(joined) == 9435 and stats.parts_joined == 8211
    assert sum(n >= 32000 for n in chars) == 644
