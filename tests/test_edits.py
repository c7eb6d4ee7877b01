"""`bundled:code-edits`: edit requests over the standard library's functions, read as a data source to regenerate."""

from __future__ import annotations

import ast
import json

import pytest

from eagle3.config import SourceConfig
from eagle3.data import edits
from eagle3.data.sources import read_conversations


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path))
    return tmp_path


def test_stdlib_functions_are_whole_functions_of_bounded_length_a_module_at_a_time():
    funcs = list(edits.stdlib_functions())
    assert len(funcs) > 1000 and len({q for q, _, _ in funcs}) > 0.95 * len(funcs)
    for qualname, code, name in funcs[:300]:
        tree = ast.parse(code)  # dedented methods parse on their own
        fn = tree.body[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name == name
        assert qualname.endswith("." + name)
        assert edits.FUNCTION_LINES[0] <= len(code.rstrip("\n").splitlines()) <= edits.FUNCTION_LINES[1]
    # interleaved: the first functions come from as many modules as there are modules
    modules = {q for q, _, _ in funcs}
    present = [m for m in edits.STDLIB_MODULES if any(q.startswith(m + ".") for q in modules)]
    first = [next(m for m in sorted(present, key=len, reverse=True) if q.startswith(m + "."))
             for q, _, _ in funcs[:len(present)]]
    assert first == present


def test_code_edits_source_asks_each_kind_in_turn_and_is_written_once(home):
    convs = list(read_conversations(SourceConfig(path="bundled:code-edits", max_records=12), for_generation=True))
    assert len(convs) == 12
    kinds = list(edits.EDITS)
    funcs = list(edits.stdlib_functions())
    for i, conv in enumerate(convs):
        qualname, code, name = funcs[i]
        kind = kinds[i % len(kinds)]
        assert conv.id.endswith(f"{qualname}/{kind}") and [t.role for t in conv.turns] == ["user"]
        assert conv.turns[0].content == edits.edit_ask(kind, code, name)
        assert code in conv.turns[0].content  # the whole function: the answer copies it
    written = home / "data"
    files = list(written.glob("code-edits-py*.jsonl"))
    assert len(files) == 1
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(rows) == len(funcs)
    mtime = files[0].stat().st_mtime_ns
    list(read_conversations(SourceConfig(path="bundled:code-edits", max_records=1), for_generation=True))
    assert files[0].stat().st_mtime_ns == mtime


def test_eval_kinds_are_edit_kinds_and_rename_names_the_function():
    assert set(edits.EVAL_KINDS) <= set(edits.EDITS)
    ask = edits.edit_ask("rename", "def f(x):\n    return x\n", "f")
    assert ask.startswith("Rename the function `f` to `f_v2`") and ask.endswith("```python\ndef f(x):\n    return x\n```")


def test_a_python_without_its_library_sources_is_told_not_given_an_empty_source(home, monkeypatch):
    monkeypatch.setattr(edits, "STDLIB_MODULES", ("no_such_module",))
    with pytest.raises(RuntimeError, match="has none of the standard library's sources"):
        list(read_conversations(SourceConfig(path="bundled:code-edits"), for_generation=True))
    assert not list(home.rglob("*.jsonl"))  # nothing written: the next run tries again
