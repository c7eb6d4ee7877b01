"""Edit requests: a function given in the prompt, asked back whole with one change (answers that copy their prompt).

    from eagle3.data.edits import EDITS, edit_ask
    edit_ask("rename", "def f(x):\n    return x\n", "f")

Two uses, disjoint on purpose:
- the `code-edit` prompt set (eagle3.prompts): HumanEval's 164 functions, the four EVAL_KINDS in turn;
- the `bundled:code-edits` data source (eagle3.data.sources): functions of Python's own standard library (read as
  text with `ast`, never imported), every kind of EDITS in turn, as prompts for the target to answer with
  `eagle3 regenerate`: the traffic where prompt lookup drafts well (an answer re-emits most of its prompt), to
  train a head on (BENCHMARKS.md "Code and edits").
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import sys
import textwrap
from collections.abc import Iterator
from itertools import chain, zip_longest
from pathlib import Path

EDITS = {
    "rename": "Rename the function `{entry}` to `{entry}_v2` (and every call to it) and return the whole function.",
    "docstring": "Rewrite the docstring of this function in your own words and return the whole function.",
    "comments": "Add a short comment to each block of this function and return the whole function.",
    "type-hints": "Add or complete the type hints of this function and return the whole function.",
    "names": "Give the local variables of this function more descriptive names and return the whole function.",
    "validation": "Add a check that raises ValueError on invalid arguments to this function and return the whole "
                  "function.",
}
EVAL_KINDS = ("rename", "docstring", "comments", "type-hints")
"""The code-edit prompt set's kinds (its card categories); the training source uses every kind of EDITS."""
EDIT_ASK = "{ask}\n\n```python\n{code}```"

STDLIB_MODULES = ("textwrap", "string", "shlex", "fnmatch", "posixpath", "ntpath", "glob", "heapq", "bisect",
                  "colorsys", "calendar", "statistics", "fractions", "difflib", "json.encoder", "json.decoder",
                  "urllib.parse", "email.utils", "html", "ipaddress", "tokenize", "random", "functools",
                  "inspect", "argparse", "configparser", "gettext", "locale", "mimetypes", "netrc", "pprint",
                  "quopri", "base64", "uu", "wave", "zipfile", "tarfile", "shutil", "tempfile", "pathlib",
                  "dataclasses", "enum", "typing", "ast", "dis", "pydoc", "traceback", "warnings", "logging",
                  "optparse", "smtplib", "http.cookies", "http.client", "urllib.request", "datetime",
                  "decimal", "operator", "copy", "reprlib", "cmd", "codeop", "filecmp", "fileinput", "sysconfig")
FUNCTION_LINES = (6, 40)
"""Functions of 6-40 lines: long enough that copying pays, short enough that the answer fits a 1K-token sample."""


def edit_ask(kind: str, code: str, entry: str) -> str:
    """The user turn asking for edit `kind` of `code` (a function named `entry`)."""
    return EDIT_ASK.format(ask=EDITS[kind].format(entry=entry), code=code)


def stdlib_functions() -> Iterator[tuple[str, str, str]]:
    """(`module.qualname`, source, name) of the standard library's functions and methods of FUNCTION_LINES lines,
    a function of each module of STDLIB_MODULES in turn (so that the first N cover them all), each module's in
    source order; a module this Python lacks is passed over."""
    per_module = []
    for module in STDLIB_MODULES:
        spec = importlib.util.find_spec(module) if module.split(".")[0] in sys.stdlib_module_names else None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            per_module.append(_functions(module, Path(spec.origin).read_text(encoding="utf-8")))
    yield from (f for f in chain.from_iterable(zip_longest(*per_module)) if f is not None)


def _functions(module: str, text: str) -> Iterator[tuple[str, str, str]]:
    # sliced per def (ast.get_source_segment splits the file on every call); newlines as ast counts lines
    lines = io.StringIO(text, newline="").readlines()

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str, str]]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if FUNCTION_LINES[0] <= node.end_lineno - node.lineno + 1 <= FUNCTION_LINES[1]:
                    # up to the end of the def's last statement (a comment after it stays out), as ast cuts it
                    last = lines[node.end_lineno - 1].encode()[:node.end_col_offset].decode()
                    code = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno - 1]) + last) + "\n"
                    yield f"{module}.{prefix}{node.name}", code, node.name

    yield from walk(ast.parse(text).body, "")


def edits_source() -> Path:
    """`bundled:code-edits`: one edit request per standard-library function, the kinds of EDITS in turn, as a JSONL
    of user prompts (written once per Python version under $EAGLE3_HOME/data; the functions are the running
    Python's)."""
    from eagle3.bundled import eagle3_home

    path = eagle3_home() / "data" / f"code-edits-py{sys.version_info[0]}{sys.version_info[1]}.jsonl"
    if not path.is_file():
        kinds, lines = list(EDITS), []
        for i, (qualname, code, name) in enumerate(stdlib_functions()):
            kind = kinds[i % len(kinds)]
            lines.append(json.dumps({"id": f"{qualname}/{kind}", "messages": [
                {"role": "user", "content": edit_ask(kind, code, name)}]}, ensure_ascii=False) + "\n")
        if not lines:
            raise RuntimeError(f"bundled:code-edits: this Python ({sys.executable}) has none of the standard library's "
                               f"sources of {', '.join(STDLIB_MODULES[:4])}, ... (a build without .py files)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        os.replace(tmp, path)  # a reader sees all of it or nothing
    return path
