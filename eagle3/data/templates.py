"""Chat templates: a Conversation -> `input_ids` and an assistant-only `loss_mask`.

    tok = load_tokenizer(cfg.target)
    ids, mask = render(conv, tok, "kimi-k2.5", thinking=True, system_prompt=None)
    prompt_ids = render_prompt(turns, tok, "auto", thinking=False)   # for generation (regenerate, eval)

The loss mask is 1 on exactly the tokens the model must GENERATE when an engine serves it: for each assistant
turn, everything after that turn's generation prompt up to and including the end-of-turn token
(`<|im_end|>`, `<|eot_id|>`, `<｜end▁of▁sentence｜>` or the tokenizer's eos). It is 0 on system and user text,
on the generation prompt (`<|im_start|>assistant\\n`, `<|im_assistant|>assistant<|im_middle|>`, ...) and on
scaffolding after the end-of-turn token (ChatML's trailing "\\n").

Most templates have no `{% generation %}` markers, so the mask is derived by rendering prefixes: for the
assistant turn i, P = render(messages[:i], add_generation_prompt=True) and S = render(messages[:i+1]); the
answer is S[len(P):], and both P and S must be prefixes of the full render (prefix stability; otherwise
TemplateError names the template, conversation and turn). The full text is tokenized ONCE (so input_ids are
exactly `tokenizer(full_text, add_special_tokens=False)`), and character spans map to tokens through the
offsets: a token is in the loss when it overlaps an answer span (the rule transformers uses for
`return_assistant_tokens_mask`). Tokenizers without offsets (slow ones such as Kimi's tiktoken tokenizer) are
tokenized segment by segment, and the concatenation is checked against the full tokenization.

Kimi-K2.5 (built-in `kimi-k2.5`): every generation prompt is the one K2.5's own chat template builds and SGLang /
vLLM serve, byte for byte, thinking on and off (tests/test_kimi_template.py renders K2.5's real template beside it):
- tools: a first `<|im_system|>tool_declare<|im_middle|>…<|im_end|>` turn holding the TypeScript namespace K2.5's
  tokenizer writes (`tools_ts_str`, eagle3.data.kimi_tools; `_tool_kwargs` passes it to any template that reads
  it, once per conversation), or where none can be written the JSON of the tools as SGLang serves them.
- calls: ids `functions.{name}:{n}` counted over the conversation as the servers issue them, results re-pointed;
  arguments rendered by `tojson` from the parsed object, as the servers pass them (chat_messages).
- think tags: with thinking on the generation prompt ends with `<think>`, so `<think>` is prompt and the answer
  `{reasoning}</think>{answer}<|im_end|>` is all mask 1, `</think>` included: the model generates it. With
  thinking off the prompt ends with `<think></think>` and the mask covers `{answer}<|im_end|>`.
- reasoning in history: K2.5 drops the reasoning of every assistant message up to the last one without tool
  calls and keeps it after (an agent loop's calls keep their thinking until its answer). One training sequence
  holds each turn once, so `answer_spans` drops the reasoning of the turns up to the last answer without calls
  before the final turn (reasoning_history_end) and keeps the rest: every prompt of the final agent loop is
  K2.5's. Turns before that train as `</think>{answer}` with thinking on (a dropped thinking is an empty one).
  The one case a single sequence cannot mirror: a turn of an earlier loop whose production prompt still held the
  reasoning of its loop's earlier calls, which the later turns' prompts drop (its prefix lacks that reasoning).
- the built-in differs from K2.5's template in one place only: a render without a generation prompt keeps the
  reasoning of the answer it ends with (K2.5's drops it, which would drop the thinking from the loss). `auto` with
  a template that drops it is refused for conversations whose reasoning the loss would cover (data.thinking on).
The built-in `kimi-k2.5` adds no default system prompt (use data.system_prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from eagle3.data.images import IMAGE_MARK, ImageError, VisionInputs
from eagle3.data.kimi_tools import deep_sorted, served_tools, typescript_declaration
from eagle3.data.types import Conversation, ToolCall, Turn

if TYPE_CHECKING:
    from eagle3.config import TargetConfig

# --------------------------------------------------------------------------------------- built-in templates
# Kimi-K2.5 as the model's own chat template renders it, with one difference (see the module docstring): the
# history whose reasoning is dropped ends at the last answer without calls, as in K2.5's, but the answer a render
# ends with (no generation prompt) keeps its reasoning, so that the loss covers the thinking K2.5 generates. Every
# generation prompt is K2.5's byte for byte. Tools are declared as `tools_ts_str` (eagle3.data.kimi_tools, passed
# by `_tool_kwargs`), compact JSON of the tools as SGLang serves them only where that is missing, as K2.5's does.
KIMI_K25 = (
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- set ns = namespace(history=-1) -%}"
    "{%- macro content(c) -%}{%- if c is string -%}{{ c }}{%- elif c is not none -%}{%- for p in c -%}"
    "{%- if p['type'] in ('image', 'image_url') -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{{ '\\n' }}{%- else -%}{{ p['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') and (add_generation_prompt or not loop.last) -%}"
    "{%- set ns.history = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}"
    "<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set name = m.get('name') or m['role'] -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>{{ name }}<|im_middle|>{{ content(m['content']) }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|><think>"
    "{%- if thinking and loop.index0 > ns.history and m.get('reasoning_content') -%}"
    "{{ m['reasoning_content'] }}{%- endif -%}</think>{{ m['content'] }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for c in m['tool_calls'] -%}<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>"
    "{%- if c['function']['arguments'] is string -%}{{ c['function']['arguments'] }}"
    "{%- else -%}{{ c['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>{{ name }}<|im_middle|>## Return of {{ m['tool_call_id'] }}"
    "{{ '\\n' }}{{ content(m['content']) }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ name }}<|im_middle|>{{ content(m['content']) }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}{%- endif -%}"
)

CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# ChatML with tools, the Hermes / Qwen2.5 convention (vLLM and SGLang parse its calls with `--tool-call-parser
# hermes`): the tools declared in the system turn as one JSON object a line inside <tools></tools>, each call a
# {"name", "arguments"} object inside <tool_call></tool_call> after the turn's text, results as a user turn of
# <tool_response> blocks (consecutive results share one turn). Without tools it renders exactly as `chatml`.
_TOOLS_HEAD = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_TAIL = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call>"
)
CHATML_TOOLS = (
    "{%- set sys = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}{{ '<|im_start|>system\\n' }}{%- if sys -%}{{ messages[0]['content'] + '\\n\\n' }}{%- endif -%}"
    "{{ '" + _TOOLS_HEAD + "' }}{%- for t in tools -%}{{ '\\n' }}{{ t | tojson }}{%- endfor -%}"
    "{{ '" + _TOOLS_TAIL + "<|im_end|>\\n' }}"
    "{%- elif sys -%}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and sys -%}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<|im_start|>assistant\\n' + m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{%- if m['content'] or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if c['function']['arguments'] is string -%}{{ c['function']['arguments'] }}"
    "{%- else -%}{{ c['function']['arguments'] | tojson }}{%- endif -%}{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)

DEEPSEEK_V3 = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + m['content'] -%}{%- endif -%}{%- endfor -%}"
    "{{- '<｜begin▁of▁sentence｜>' + ns.system -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)

BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    "kimi-k2.5": (KIMI_K25, ("<|im_end|>",)),
    "chatml": (CHATML, ("<|im_end|>",)),
    "chatml-tools": (CHATML_TOOLS, ("<|im_end|>",)),
    "llama3": (LLAMA3, ("<|eot_id|>",)),
    "deepseek-v3": (DEEPSEEK_V3, ("<｜end▁of▁sentence｜>",)),
}
# End-of-turn strings looked for in `auto` / file templates (plus the tokenizer's eos).
KNOWN_EOT = ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")


class TemplateError(ValueError):
    """The template cannot give a trustworthy loss mask (not prefix-stable, or no template at all)."""


ToolStyle = Literal["kimi", "hermes"]


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    """`auto`, a built-in name, or the Jinja file path."""
    text: str
    eot: tuple[str, ...]
    """End-of-turn strings; the answer's mask ends after the last one found in the answer span."""

    @property
    def tool_style(self) -> ToolStyle | None:
        """How the template writes a call, read off its text: Kimi's marker tokens (`<|tool_call_begin|>`) or
        Hermes' `<tool_call>` tags; None for a template that writes no calls."""
        if "<|tool_call_begin|>" in self.text:
            return "kimi"
        if "<tool_call>" in self.text:
            return "hermes"
        return None

    @property
    def arguments_as_text(self) -> bool:
        """Whether calls' arguments reach the template as the JSON text the model wrote, or parsed.

        SGLang and vLLM parse every history call's arguments into an object before they render the prompt, and the
        template writes it back with `tojson` (`json.dumps`: `", "` and `": "`, non-ASCII kept): K2.5 is served
        `{"city": "Rome"}` whatever text the call had. So every template gets objects, Kimi's included, except
        eagle3's `chatml-tools`, which prints the text as written (its SmolLM2 recipes train on the text the model
        generates)."""
        return self.name in BUILTIN and self.tool_style != "kimi"

    @property
    def declares_typescript(self) -> bool:
        """Kimi-K2.5's template family: the tokenizer hands it `tools_ts_str` (and key-sorted `tools`)."""
        return "tools_ts_str" in self.text


def resolve_template(template: str | ChatTemplate, tokenizer: Any) -> ChatTemplate:
    """Turn `data.chat_template` (auto / built-in name / Jinja file) into the template text to render with."""
    if isinstance(template, ChatTemplate):
        return template
    eos = getattr(tokenizer, "eos_token", None)
    extra = (eos,) if isinstance(eos, str) and eos else ()
    if template in BUILTIN:
        text, eot = BUILTIN[template]
        return ChatTemplate(template, text, eot)
    if template == "auto":
        text = getattr(tokenizer, "chat_template", None)
        if isinstance(text, dict):  # several named templates: use the default one
            text = text.get("default")
        if not text:
            where = getattr(tokenizer, "name_or_path", "?")
            raise TemplateError(f"data.chat_template=auto, but the tokenizer at {where} has no chat template; "
                                f"set data.chat_template to one of {sorted(BUILTIN)} or a path to a Jinja file")
        return ChatTemplate("auto", text, tuple(dict.fromkeys(extra + KNOWN_EOT)))
    p = Path(template).expanduser()
    if p.is_file():
        return ChatTemplate(str(p), p.read_text(encoding="utf-8"), tuple(dict.fromkeys(extra + KNOWN_EOT)))
    raise TemplateError(f"data.chat_template={template!r}: not a built-in template ({', '.join(sorted(BUILTIN))}, "
                        f"auto) and not an existing Jinja file")


# ----------------------------------------------------------------------------------------------- rendering
def chat_messages(turns: list[Turn], thinking: bool, tpl: ChatTemplate | None = None) -> list[dict[str, Any]]:
    """Turns -> the message dicts chat templates read, as a client sends them to SGLang or vLLM: every assistant
    turn's `reasoning_content` (thinking mode only; the template decides which it keeps), `tool_calls` and tool
    results in the OpenAI shape, arguments parsed unless the template prints text (ChatTemplate.arguments_as_text).

    A Kimi-style template prints call ids, and Kimi's servers issue `functions.{name}:{n}`, n = the calls already
    in the request's history + the call's index in its turn (SGLang's and vLLM's `kimi_k2` parsers): the
    conversation's calls counted from 0. Ids are rewritten to that whatever the source used (per-turn ids, ids
    reused in later turns, none), and each result is re-pointed to the renamed call it answers: the call of the
    latest call turn with its id, else (no id) the next one that turn has not had a result for."""
    kimi = tpl is not None and tpl.tool_style == "kimi"
    as_text = tpl is None or tpl.arguments_as_text
    n = 0
    pending: list[tuple[str | None, str]] = []  # the latest call turn's unanswered calls: (source id, rendered id)
    out: list[dict[str, Any]] = []
    for t in turns:
        m: dict[str, Any] = {"role": t.role, "content": content_parts(t) if t.images else t.content}
        if thinking and t.role == "assistant" and t.reasoning:
            m["reasoning_content"] = t.reasoning
        if t.tool_calls:
            calls = []
            pending = []
            for c in t.tool_calls:
                cid = f"functions.{c.name}:{n}" if kimi else c.id
                pending.append((c.id, cid))
                n += 1
                args: Any = c.arguments if as_text else json.loads(c.arguments)
                calls.append({"id": cid, "type": "function", "function": {"name": c.name, "arguments": args}})
            m["tool_calls"] = calls
        if t.role == "tool":
            cid = t.tool_call_id
            if kimi:
                hit = next((p for p in pending if p[0] == cid), None)
                if hit is None and cid is None and pending:
                    hit = pending[0]
                if hit is not None:
                    pending.remove(hit)
                    cid = hit[1]
            if cid is not None:  # no id, no call to answer: left out, as SGLang drops null fields (K2.5 prints "")
                m["tool_call_id"] = cid
            if t.name is not None:
                m["name"] = t.name
        out.append(m)
    return out


def content_parts(t: Turn) -> list[dict[str, Any]]:
    """A turn with images as OpenAI content parts, `{"type": "image"}` where each stands (every VLM template renders
    its placeholder for it; the processor expands it, eagle3.data.images)."""
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(t.content.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _tool_kwargs(tpl: ChatTemplate, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The template's tool arguments as the target is served them. K2.5's family gets the tools SGLang hands K2.5's
    tokenizer (served_tools: its request model's dump), key-sorted by that tokenizer, and their TypeScript
    declaration as `tools_ts_str` where the encoder writes one (with or without the remote code loaded); any other
    template the tools as given. Built once per conversation (answer_spans renders about two prompts per assistant
    turn): sorting and encoding a big tool set on every render made prepare on long agent traces pay it each time."""
    if not tools:
        return {"tools": None}
    if not tpl.declares_typescript:
        return {"tools": tools}
    served = deep_sorted(served_tools(tools))
    ts = typescript_declaration(served)
    return {"tools": served} if ts is None else {"tools": served, "tools_ts_str": ts}


def _apply(tokenizer: Any, tpl: ChatTemplate, messages: list[dict[str, Any]], gen: bool, thinking: bool,
           tools: list[dict[str, Any]] | None = None, tool_kwargs: dict[str, Any] | None = None) -> str:
    """Render with the template, given what the target's own tokenizer would give it (`tool_kwargs`: `tools` made
    ready once by _tool_kwargs; else built here from `tools`)."""
    text = tokenizer.apply_chat_template(
        messages, chat_template=tpl.text, tokenize=False, add_generation_prompt=gen, thinking=thinking,
        enable_thinking=thinking, **(tool_kwargs if tool_kwargs is not None else _tool_kwargs(tpl, tools)),
    )
    if not isinstance(text, str):
        raise TemplateError(f"chat template {tpl.name!r}: rendering did not return text ({type(text).__name__})")
    return text


TOOL_TEMPLATES = ("kimi-k2.5", "chatml-tools")
"""The built-ins that render tools (for the message that names them)."""
_PROBE = "eagle3_probe"


def renders_tools(tokenizer: Any, tpl: ChatTemplate) -> bool:
    """Whether the template renders all of a tool conversation: a probe's declaration, call (name and argument)
    and result must all appear in its output. A template that ignores them (plain ChatML, SmolLM2's own) would
    train a head on conversations with the tools silently missing."""
    probe = Conversation("probe", [
        Turn("user", "q"),
        Turn("assistant", "", tool_calls=(ToolCall(f"{_PROBE}_fn", json.dumps({f"{_PROBE}_arg": 1}), "call_0"),)),
        Turn("tool", f"{_PROBE}_result", tool_call_id="call_0", name=f"{_PROBE}_fn"),
        Turn("assistant", "done"),
    ], tools=[{"type": "function", "function": {"name": f"{_PROBE}_fn", "description": f"{_PROBE}_doc",
                                                "parameters": {"type": "object", "properties": {}}}}])
    try:
        text = _apply(tokenizer, tpl, chat_messages(probe.turns, False, tpl), False, False, probe.tools)
    except Exception:  # noqa: BLE001 - a template that raises on tools (raise_exception, a missing key) cannot
        return False
    return all(x in text for x in (f"{_PROBE}_doc", f"{_PROBE}_arg", f"{_PROBE}_result")) and text.count(
        f"{_PROBE}_fn") >= 2


def check_renders_tools(tokenizer: Any, tpl: ChatTemplate, needing: int, of: int, what: str) -> None:
    """Refuse to render `needing` conversations with tools (of `of`) through a template that drops them."""
    if needing and not renders_tools(tokenizer, tpl):
        raise TemplateError(
            f"{needing} of {of} {what} use tools (declarations, calls or results), but data.chat_template="
            f"{tpl.name!r} does not render them (a probe's tools, call and result do not all appear in its output). "
            f"Set data.chat_template to a template that does: {' or '.join(TOOL_TEMPLATES)} (built-in: Kimi-K2.5's "
            f"format, and ChatML with Hermes/Qwen-style tool calls for ChatML models such as SmolLM2), or a Jinja "
            f"file of the target's own")


def _with_system(turns: list[Turn], system_prompt: str | None) -> list[Turn]:
    if system_prompt is not None and (not turns or turns[0].role != "system"):
        return [Turn(role="system", content=system_prompt), *turns]
    return list(turns)


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _not_prefix(tpl: ChatTemplate, conv_id: str, turn: int, what: str, short: str, long: str) -> TemplateError:
    k = _first_diff(short, long)
    return TemplateError(
        f"chat template {tpl.name!r} is not prefix-stable at turn {turn} of conversation {conv_id!r}: {what}; "
        f"first difference at char {k}: {short[max(0, k - 30):k + 30]!r} vs {long[max(0, k - 30):k + 30]!r}. "
        f"The assistant-only loss mask cannot be derived; use a prefix-stable template (data.chat_template)")


def reasoning_history_end(turns: list[Turn], tpl: ChatTemplate) -> int:
    """The last turn whose reasoning the one training sequence drops (-1: none); later turns keep theirs.

    A rendered conversation is one sequence, so a turn's reasoning is either in it or not; it is kept where the
    answers after it were served with it. Kimi's templates keep reasoning after the last answer without tool
    calls (K2.5's rule): the history ends at the last such answer that is not the conversation's final turn, so
    the final agent loop (its calls and its answer) keeps its thinking and every prompt in it is K2.5's. Other
    templates (Qwen3's rule): the history ends before the last user turn."""
    if tpl.tool_style == "kimi":
        return max((i for i, t in enumerate(turns[:-1]) if t.role == "assistant" and not t.tool_calls), default=-1)
    return max((i for i, t in enumerate(turns) if t.role == "user"), default=0) - 1


_KEEPS_FINAL_REASONING: dict[str, bool] = {}
_REASONING_PROBE = "eagle3_reasoning_probe"


def keeps_final_reasoning(tokenizer: Any, tpl: ChatTemplate) -> bool:
    """Whether the template writes the reasoning of the answer a conversation ends with, the one the loss covers.
    K2.5's own does not: its history runs up to the last answer without calls, that answer included, so a
    finished conversation renders every answer as `<think></think>...` (probed once per template text)."""
    if tpl.text not in _KEEPS_FINAL_REASONING:
        probe = [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "a", "reasoning_content": _REASONING_PROBE}]
        _KEEPS_FINAL_REASONING[tpl.text] = _REASONING_PROBE in _apply(tokenizer, tpl, probe, gen=False, thinking=True)
    return _KEEPS_FINAL_REASONING[tpl.text]


def answer_spans(conv: Conversation, tokenizer: Any, template: str | ChatTemplate, thinking: bool,
                 system_prompt: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character spans [start, end) the loss covers (see module docstring)."""
    tpl = resolve_template(template, tokenizer)
    turns = _with_system(conv.turns, system_prompt)
    if thinking:  # drop here the reasoning the template drops from the full render (prefix stability)
        history_end = reasoning_history_end(turns, tpl)
        turns = [t.with_(reasoning=None) if i <= history_end else t for i, t in enumerate(turns)]
        if (tpl.tool_style == "kimi" and any(t.reasoning for t in turns if t.role == "assistant")
                and not keeps_final_reasoning(tokenizer, tpl)):
            raise TemplateError(
                f"chat template {tpl.name!r} drops the reasoning of the answer a conversation ends with (Kimi-K2.5's "
                f"own template keeps reasoning only after the last answer without tool calls), so conversation "
                f"{conv.id!r} would train without the thinking K2.5 generates, or fail as not prefix-stable. Set "
                f"data.chat_template=kimi-k2.5: the built-in renders K2.5's prompts byte for byte and keeps each "
                f"trained answer's reasoning; or set data.thinking=false")
    messages = chat_messages(turns, thinking, tpl)
    tools = _tool_kwargs(tpl, conv.tools)
    full = _apply(tokenizer, tpl, messages, gen=False, thinking=thinking, tool_kwargs=tools)
    spans: list[tuple[int, int]] = []
    for i, t in enumerate(turns):
        if t.role != "assistant":
            continue
        prompt = _apply(tokenizer, tpl, messages[:i], gen=True, thinking=thinking, tool_kwargs=tools) if i else ""
        with_answer = _apply(tokenizer, tpl, messages[: i + 1], gen=False, thinking=thinking, tool_kwargs=tools)
        if not with_answer.startswith(prompt):
            raise _not_prefix(tpl, conv.id, i, "the generation prompt is not a prefix of the render with the answer",
                              prompt, with_answer)
        if not full.startswith(with_answer):
            raise _not_prefix(tpl, conv.id, i, "the render up to this answer is not a prefix of the full render",
                              with_answer, full)
        start, end = len(prompt), len(with_answer)
        answer = full[start:end]
        cut = max((answer.rfind(e) + len(e) for e in tpl.eot if e in answer), default=-1)
        end = start + (cut if cut >= 0 else len(answer.rstrip()))
        if end > start:
            spans.append((start, end))
    return full, spans


def _mask_from_offsets(offsets: Any, spans: list[tuple[int, int]]) -> list[int]:
    """1 where a token [s, e) overlaps a span: the first span ending after s must start before e (vectorised)."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans or not len(off):
        return [0] * len(off)
    sp = np.asarray(spans, dtype=np.int64)
    j = np.searchsorted(sp[:, 1], off[:, 0], side="right")
    inside = j < len(sp)
    mask = np.zeros(len(off), dtype=np.int8)
    mask[inside] = off[inside, 1] > sp[j[inside], 0]
    return mask.tolist()


def tokenize_with_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenize `text` once; mark tokens overlapping `spans`. Slow tokenizers: per segment, checked against full.

    Fast tokenizers go straight to their Rust backend (`backend_tokenizer.encode`, what `tokenizer(text,
    add_special_tokens=False)` runs too, minus the Python-side conversion that dominated the time)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, _mask_from_offsets(enc.offsets, spans)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), _mask_from_offsets(enc["offset_mapping"], spans)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for s, e in [*spans, (len(text), len(text))]:
        for seg, m in ((text[pos:s], 0), (text[s:e], 1)):
            if seg:
                seg_ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
                ids += seg_ids
                mask += [m] * len(seg_ids)
        pos = e
    full_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if ids != full_ids:
        raise TemplateError("tokenizing the prompt and answer segments separately differs from tokenizing the full "
                            "text (a token crosses a segment boundary) and this tokenizer has no offsets mapping")
    return ids, mask


def render(conv: Conversation, tokenizer: Any, template: str | ChatTemplate, thinking: bool,
           system_prompt: str | None = None, vision: VisionInputs | None = None) -> tuple[list[int], list[int]]:
    """Render a conversation: (input_ids, loss_mask) with the mask on what the assistant generates. A conversation
    with images needs the target's processor (`vision`): each image's placeholder becomes the tokens the processor
    makes of it, all prompt; without one it raises ImageError("non_text_part"): a text-only target never trains an
    image's placeholder as text."""
    if conv.images and vision is None:
        raise ImageError("non_text_part", f"conversation {conv.id!r} has images and the target has no image processor")
    text, spans = answer_spans(conv, tokenizer, template, thinking, system_prompt)
    if conv.images:
        text, spans = vision.expand(text, spans, conv.images)
    return tokenize_with_mask(tokenizer, text, spans)


def render_prompt(turns: list[Turn], tokenizer: Any, template: str | ChatTemplate, thinking: bool,
                  system_prompt: str | None = None, tools: list[dict[str, Any]] | None = None,
                  vision: VisionInputs | None = None) -> list[int]:
    """Token ids of the generation prompt for the next assistant turn after `turns` (regenerate / eval); a prompt
    with images needs the target's processor (`vision`), which expands each image's placeholder as `render` does."""
    refs = [i for t in turns for i in t.images]
    if refs and vision is None:
        raise TemplateError("a prompt with images needs a vision-language target and its processor (the target "
                            "has none, or this stage sends text prompts only)")
    tpl = resolve_template(template, tokenizer)
    text = _apply(tokenizer, tpl, chat_messages(_with_system(turns, system_prompt), thinking, tpl), gen=True,
                  thinking=thinking, tools=tools)
    if refs:
        text, _ = vision.expand(text, [], refs)  # type: ignore[union-attr]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(target: TargetConfig) -> Any:
    """The target's tokenizer: bundled names resolved, remote code as configured, slow when there is no fast one.

    Kimi's tokenizer is tiktoken-based remote code without a fast version; AutoTokenizer normally picks the slow
    class itself, and `use_fast=False` is retried when the fast attempt fails."""
    from transformers import AutoTokenizer

    from eagle3.bundled import resolve_target_path

    path = resolve_target_path(target.path)
    kwargs = {"trust_remote_code": target.trust_remote_code, "revision": target.revision}
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (ValueError, OSError, TypeError, ImportError) as first:
        try:
            return AutoTokenizer.from_pretrained(path, use_fast=False, **kwargs)
        except Exception:
            raise RuntimeError(f"cannot load the tokenizer of target.path={target.path!r} ({path}): {first}"
                               ) from first
