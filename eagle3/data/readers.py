"""A conversation source's file or folder as (record index, raw record), whatever its container: a JSON array streamed
(a truncated tail recovered), JSONL (malformed lines counted), a `datasets` folder; every replaced UTF-8 byte
counted; ShareGPT V3's split records joined back on request (`join_parts`). What the records mean is
eagle3.data.sources' job."""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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
    parts_joined: int = 0
    """Split records merged into the conversation before them (`SourceConfig.join_parts`)."""

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
            "parts_joined": self.parts_joined,
        }


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


_PART_ID = re.compile(r"(.+)_(\d+)")


def join_parts(records: Iterable[tuple[int, Any]], stats: SourceStats) -> Iterator[tuple[int, Any]]:
    """Consecutive records `<id>_<k>` of one conversation joined back into one (`SourceConfig.join_parts`), with the
    first part's id and record index; each part merged into an earlier one is counted in `stats.parts_joined`."""
    held: tuple[int, dict[str, Any], str, int, str] | None = None  # (index, record, base id, end offset, list key)
    for index, record in records:
        part = _split_part(record)
        if held is not None and part is not None:
            h_index, h_record, base, end, key = held
            p_base, start, p_key = part
            messages = record[p_key]
            overlap = end - start
            if (p_base == base and p_key == key and 0 <= overlap <= min(len(messages), len(h_record[key]))
                    and h_record[key][len(h_record[key]) - overlap:] == messages[:overlap]):
                h_record[key] = h_record[key] + messages[overlap:]
                held = (h_index, h_record, base, start + len(messages), key)
                stats.parts_joined += 1
                continue
        if held is not None:
            yield held[0], held[1]
            held = None
        if part is None:
            yield index, record
        else:
            held = (index, dict(record), part[0], part[1] + len(record[part[2]]), part[2])
    if held is not None:
        yield held[0], held[1]


def conversation_id(record_id: str) -> str:
    """ShareGPT V3's conversation id of a record `<id>_<k>` (the id itself when it has no `_<k>`)."""
    m = _PART_ID.fullmatch(record_id)
    return m.group(1) if m else record_id


def _split_part(record: Any) -> tuple[str, int, str] | None:
    """(base id, offset of the first message, the messages' key) of a record whose id reads `<id>_<k>`."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    m = _PART_ID.fullmatch(record["id"])
    key = next((k for k in ("conversations", "messages") if isinstance(record.get(k), list)), None)
    return (m.group(1), int(m.group(2)), key) if m and key else None


# ---------------------------------------------------------------------------------------------- file readers
_WS = re.compile(r"[ \t\r\n]*")


class _TextBuffer:
    """UTF-8 text of a binary file, read chunk by chunk behind a parse position (iter_json_array)."""

    def __init__(self, f: BinaryIO, stats: SourceStats, chunk_bytes: int):
        self.f, self.stats, self.chunk_bytes = f, stats, chunk_bytes
        self.incremental = codecs.getincrementaldecoder("utf-8")(errors="eagle3-count-replace")
        self.buf, self.pos, self.want = "", 0, chunk_bytes
        self.eof = not self.refill()

    def refill(self) -> bool:
        """Drop the parsed text, append the next `want` bytes' text; False at end of file."""
        data = self.f.read(self.want)
        before = _replaced[0]
        text = self.incremental.decode(data, final=not data)
        self.stats.utf8_replacements += _replaced[0] - before
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        self.eof = not data
        return bool(data)

    def skip_space(self) -> None:
        self.pos = _WS.match(self.buf, self.pos).end()

    def rest(self) -> str:
        """Everything not parsed, to the end of the file."""
        rest = self.buf[self.pos:]
        return rest if self.eof else rest + self.f.read().decode("utf-8", errors="replace")


def iter_json_array(path: Path, stats: SourceStats, chunk_bytes: int = 4 << 20) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array; stop cleanly at a truncated or malformed tail.

    raw_decode parses one element at a time out of a text buffer that is refilled chunk by chunk; an element
    that does not parse yet is retried with more text (reading geometrically larger chunks so a broken tail
    costs O(n), not O(n^2)). Whatever is left unparsed at end of file is the truncated tail."""
    decoder = json.JSONDecoder()
    index = 0
    with open(path, "rb") as f:
        t = _TextBuffer(f, stats, chunk_bytes)
        t.buf = t.buf.lstrip("\ufeff")
        t.skip_space()
        if not t.buf.startswith("[", t.pos):
            raise ValueError(f"{path}: expected a JSON array starting with '['")
        t.pos += 1
        expect_comma = False
        while True:
            t.skip_space()
            if t.pos >= len(t.buf):
                if t.eof:
                    break
                t.refill()
                continue
            ch = t.buf[t.pos]
            if ch == "]":
                return
            if expect_comma:
                if ch != ",":
                    break  # garbage between elements: stop and report the rest as dropped
                t.pos += 1
                expect_comma = False
                continue
            try:
                obj, end = decoder.raw_decode(t.buf, t.pos)
            except json.JSONDecodeError:
                if t.eof:
                    break
                t.refill()
                t.want *= 2  # a long element (or a broken tail): read more each time
                continue
            except (ValueError, RecursionError):
                break  # parseable but unreadable (an int over 4300 digits, nesting too deep): stop, report the rest
            t.want, t.pos, expect_comma = chunk_bytes, end, True
            yield index, obj
            index += 1
        rest = t.rest()  # did not parse: the truncated (or malformed) tail
        stats.truncated_bytes = len(rest.encode("utf-8", errors="replace"))
        if rest.strip():
            stats.skipped["truncated_tail"] += 1


def iter_jsonl(path: Path, stats: SourceStats) -> Iterator[tuple[int, Any]]:
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


def iter_hf(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
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

