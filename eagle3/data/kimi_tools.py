"""Kimi-K2.5's tool declaration: OpenAI tools -> the TypeScript namespace K2.5 is served with.

    tools = deep_sorted(served_tools(tools))  # what K2.5's template gets as `tools` when SGLang serves it
    ts = typescript_declaration(tools)        # the template's `tools_ts_str`, or None (then K2.5 declares JSON)

K2.5 does not see its tools as JSON. Its tokenizer (`tokenization_kimi.py`, with `tool_declaration_ts.py`, both in
the model repository) sorts every key of `tools` recursively and passes the chat template `tools_ts_str`, which the
template prints in the `tool_declare` turn; the template falls back to compact JSON only when that string is
missing or empty (no function tools, or a schema the encoder raises on). SGLang and vLLM serve K2.5 through that
tokenizer, so this is the declaration in every agentic request, thousands of tokens of it. A head trained on
`{"city":{"type":"string"}}` learns argument names after `"city":` tokens where it serves against `city:`. The
servers hand the tokenizer the tools as their request models dump them (served_tools: nulls added), which only
the JSON fallback shows.

The format, for one function (a namespace holds every function tool, one after another):

    # Tools

    ## functions
    namespace functions {
    // Current weather for a city.
    type get_weather = (_: {
      city: string,
      // Default: "c"
      unit?: "c" | "f"
    }) => any;
    }

- fields: required ones first, each group sorted by name; optional ones marked `?`; each field's description
  (`// ` per line, an empty line left empty), its constraints (`// maxLength: 8, minLength: 1`: strings' length
  and pattern, numbers' bounds, arrays' item counts, sorted by key) and its default (`// Default: ...`) above it;
  nested objects indented two spaces a level; `additionalProperties` as `[k: string]: T` (`any` / `never`).
- types: `integer` -> `number`; `enum` -> `"a" | "b" | 3`; `anyOf` -> `A | B`; a type list -> `string | null`
  (`object` -> `{}`, `array` -> `Array<any>`); arrays `Array<T>`, or `Array<` newline + the item's comments and
  type one level in + newline `>` when the item has a description or constraints; `{}` or `true` -> `any`.
- `$defs` become `interface Name {...}` lines before the function (a `$ref` is the name). A `$ref: "#"` in the
  parameters themselves makes them an `interface parameters` (fields as listed, signature `(_: parameters)`); the
  encoder decides that before it writes the definitions, so a `$ref: "#"` met only inside `$defs` prints
  `parameters` there, declares no such interface and leaves the signature inline (a name never declared: K2.5's).
- a `type` that is not a string or a list (`null`, `5`, an object) is a scalar named by the value, printed with
  `str`: `x?: None`; where the encoder joins or concatenates that text instead (an `anyOf` option, an array item
  with comments) it raises, and the tools go out as JSON.
- Python spellings where the encoder prints values with `str` / `repr`: `True`, `None`, `1.0`; defaults that are
  not numbers or booleans as JSON (`"c"`, `[1, 2]`).

The facts come from the public copies of K2.5's encoder (tinker-cookbook `kimi_k2_5_tool_declaration_ts.py`, "copied
from kimi-k2.5-hf-tokenizer"; the same file in other projects) and SGLang's Rust port of it; where they differ (an
array of objects without item comments: the Python keeps the item at the array's own indent, the Rust port indents
it one level more) this module follows the Python, which is what the model's tokenizer runs. Written here, not
copied: eagle3 must render the declaration without the model's remote code (a converted tokenizer, tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

INDENT = "  "
_FIELDS = ",\n"
_CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
_UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
                "object": "{}", "array": "Array<any>"}


class UnsupportedSchema(ValueError):
    """A schema K2.5's encoder raises on (it then declares the tools as JSON, and so does eagle3)."""


def deep_sorted(value: Any) -> Any:
    """Every mapping's keys sorted, recursively; lists keep their order. K2.5's tokenizer does this to `tools` so
    that one tool set always renders to the same bytes (a prefix-cache hit); it decides the order of `$defs` and
    of the JSON fallback."""
    if isinstance(value, dict):
        return {k: deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sorted(v) for v in value]
    return value


_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
"""SGLang 0.5.23's `Function` fields, in its order (sglang/srt/entrypoints/openai/protocol.py)."""


def served_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as SGLang 0.5.23 hands them to K2.5's tokenizer: `Tool(**t).model_dump()` for each, its request
    model. Only the JSON fallback shows the difference (the TypeScript reads none of it), but there it is in every
    request: `{"type": "function", "function": {...}, "defer_loading": null}` for every tool, the function with
    `"description": null` and `"parameters": null` where the client left them out, `strict` / `defer_loading` only
    where set (a tool's `defer_loading` copied into its function), any key neither model defines dropped, and a
    missing `type` made "function". A tool SGLang refuses (400: no `function`, a name that is not a string) is kept
    as given: no server renders it. vLLM differs in one key (docs/kimi-k2.5.md, "Agentic traces")."""
    return [_served_tool(t) for t in tools]


def _served_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """One `Tool(**tool).model_dump()`: the tool's fields in the model's order, the function's in the client's order
    followed by the defaults it left out (SGLang's serializer keeps the client's key order; K2.5 sorts them anyway)."""
    given = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(given, dict) or not isinstance(given.get("name"), str):
        return tool
    defer = tool.get("defer_loading")
    function = {k: given.get(k) for k in _FUNCTION_FIELDS}
    if function["defer_loading"] is None:
        function["defer_loading"] = defer
    order = [k for k in given if k in function] + [k for k in _FUNCTION_FIELDS if k not in given]
    dumped = {k: function[k] for k in order if function[k] is not None or k not in ("strict", "defer_loading")}
    return {"type": tool.get("type", "function"), "function": dumped, "defer_loading": defer}


def typescript_declaration(tools: list[dict[str, Any]] | None) -> str | None:
    """`tools_ts_str` as K2.5's tokenizer computes it for these OpenAI tools; None where the template is left to
    its JSON fallback (no function tool, or a schema the encoder cannot write, e.g. `oneOf` or a `$ref` to a
    definition it has not seen)."""
    if not tools:
        return None
    try:
        functions = [_function(t["function"]) for t in deep_sorted(tools)
                     if t.get("type") == "function" and t.get("function")]
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        # K2.5's tokenizer catches every error of its encoder and leaves `tools_ts_str` unset.
        return None
    if not functions:
        return None
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


# ----------------------------------------------------------------------------------------------- the schema tree
@dataclass
class _Type:
    kind: str
    """scalar (its name in `name`), object, array, enum, anyof, union, ref."""
    description: Any = ""
    constraints: dict[str, Any] = field(default_factory=dict)
    name: Any = ""
    """scalar: the schema's `type` as given (any JSON value, not only a string); ref: the referenced name."""
    fields: list[_Field] = field(default_factory=list)
    extra: Any = None
    """object: `additionalProperties` (None absent, True, False, a _Type, or what the encoder raises on if written)."""
    items: list[_Type] = field(default_factory=list)
    """array: [item]; anyof: the options."""
    values: list[Any] = field(default_factory=list)
    """enum: the values; union: the TypeScript names."""


@dataclass
class _Field:
    name: str
    type: _Type
    optional: bool
    default: Any


@dataclass
class _Registry:
    """`$defs` met so far, in the order met (later ones with the same name replace the schema, not the place)."""

    definitions: dict[str, Any] = field(default_factory=dict)
    self_ref: bool = False


def _base(schema: dict[str, Any], kind: str, constraint_keys: tuple[str, ...] = ()) -> _Type:
    """A node with what every kind carries: the description and the constraints its kind prints (`constraint_keys`)."""
    return _Type(kind, schema.get("description", ""), {k: v for k, v in schema.items() if k in constraint_keys})


def _parse(schema: Any, reg: _Registry) -> _Type:
    """One JSON Schema -> its node. The order of the checks is the encoder's: `$ref`, `anyOf`, `enum`, `type`."""
    if isinstance(schema, bool):
        return _Type("scalar", name="any" if schema else "null")
    if "$ref" in schema:
        return _ref(schema, reg)
    if "anyOf" in schema:
        node = _base(schema, "anyof")
        node.items = [_parse(s, reg) for s in schema["anyOf"]]
        return node
    if "enum" in schema:
        return _enum(schema)
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            if any(k not in _UNION_NAMES for k in kind):
                raise UnsupportedSchema(f"type {kind}")
            node = _base(schema, "union")
            node.values = [_UNION_NAMES[k] for k in kind]
            return node
        if kind == "object":
            return _object(schema, reg)
        if kind == "array":
            node = _base(schema, "array", _CONSTRAINTS["array"])
            node.items = [_parse(schema["items"], reg) if schema.get("items") else _Type("scalar", name="any")]
            return node
        # Any other value is a scalar named by the value itself, a string or not (`null`, `5`, an object): the
        # encoder keeps it and prints it with `str` (see _joined). `in` a tuple, not a dict lookup: it may not hash.
        node = _base(schema, "scalar", _CONSTRAINTS[kind] if kind in ("string", "number", "integer") else ())
        node.name = kind
        return node
    if schema == {}:
        return _Type("scalar", name="any")
    raise UnsupportedSchema(f"no type in {schema!r}")


def _object(schema: dict[str, Any], reg: _Registry) -> _Type:
    """An object: its `$defs` registered first (its own properties may refer to them), then its fields."""
    node = _base(schema, "object")
    if not schema:
        return node
    if schema.get("$defs"):
        reg.definitions.update(schema["$defs"].items())  # `.items()`: the encoder's; a list of pairs raises there too
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        extra = _parse(extra, reg)  # parsed before the properties: it may register definitions they refer to
    # Any other value but a bool raises only when written (_write_object), as in the encoder: the self-referring
    # parameters' own `additionalProperties` is never written, so there it raises nothing.
    node.extra = extra
    if "properties" not in schema:
        return node
    required = set(schema.get("required", []))
    node.fields = [_Field(name, _parse(prop, reg), name not in required,
                          prop.get("default") if isinstance(prop, dict) else None)
                   for name, prop in schema["properties"].items()]
    return node


def _ref(schema: dict[str, Any], reg: _Registry) -> _Type:
    """A `$ref` prints as a name: `#` is the parameters (noted in `reg`), `#/$defs/X` must be registered by now."""
    ref = schema["$ref"]
    node = _base(schema, "ref")
    if ref == "#":
        reg.self_ref = True
        node.name = "parameters"
    elif isinstance(ref, str) and ref.startswith("#/$defs/") and isinstance(
            reg.definitions.get(ref.split("/")[-1]), dict):
        node.name = ref.split("/")[-1]
    else:
        raise UnsupportedSchema(f"$ref {ref!r}")
    return node


def _enum(schema: dict[str, Any]) -> _Type:
    """Enum values are checked against a declared type (the encoder raises on `type: string` with a number)."""
    node = _base(schema, "enum")
    node.values = list(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        if len(kind) == 1:
            kind = kind[0]
        elif len(kind) == 2 and "null" in kind:
            kind = kind[0] if kind[0] != "null" else kind[1]
        else:
            raise UnsupportedSchema(f"enum of type {kind}")
    fits = {"string": str, "number": (int, float), "integer": int, "boolean": bool}.get(kind) if isinstance(
        kind, str) else None
    if fits and any(v is not None and not isinstance(v, fits) for v in node.values):
        raise UnsupportedSchema(f"enum {node.values} is not all {kind}")
    return node


# ------------------------------------------------------------------------------------------------------ writing
def _comment(text: str, indent: str) -> str:
    """A description as `// ` lines at `indent`; an empty line stays empty (no bare `//`), as the encoder writes it."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _comments(node: _Type, indent: str) -> str:
    """The lines above a field or an array item: its description, then its constraints."""
    lines = []
    if node.description:
        lines.append(_comment(node.description, indent))
    if node.constraints:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(node.constraints.items())))
    return "".join(line + "\n" for line in lines)


def _write(node: _Type, indent: str) -> str:
    """A node's TypeScript as it stands after `name: `, nested lines indented from `indent` (the field's own)."""
    if node.kind == "scalar":
        return "number" if node.name == "integer" else str(node.name)
    if node.kind == "ref":
        return node.name
    if node.kind == "union":
        return " | ".join(node.values)
    if node.kind == "enum":
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in node.values)
    if node.kind == "anyof":
        return " | ".join(_joined(t, indent) for t in node.items)
    if node.kind == "array":
        item, inner = node.items[0], indent + INDENT
        notes = _comments(item, inner)
        if notes:
            return f"Array<\n{notes}{inner}{_joined(item, inner)}\n{indent}>"
        return f"Array<{_write(item, indent)}>"
    return _write_object(node, indent)


def _joined(node: _Type, indent: str) -> str:
    """`_write` where the encoder joins or concatenates the text (`anyOf` options, a commented array item) instead of
    formatting it: a scalar whose `type` is not a string raises there (TypeError in the encoder, so JSON instead)."""
    if node.kind == "scalar" and not isinstance(node.name, str):
        raise UnsupportedSchema(f"type {node.name!r} joined as text")
    return _write(node, indent)


def _write_object(node: _Type, indent: str) -> str:
    """`{` + required fields then optional ones, each group by name, + `[k: string]: T` + `}`; `{}` when empty."""
    inner = indent + INDENT
    ordered = sorted((f for f in node.fields if not f.optional), key=lambda f: f.name) + sorted(
        (f for f in node.fields if f.optional), key=lambda f: f.name)
    parts = [_write_field(f, inner) for f in ordered]
    if node.extra is not None:
        if isinstance(node.extra, bool):
            extra = "any" if node.extra else "never"
        elif isinstance(node.extra, _Type):
            extra = _write(node.extra, inner)
        else:
            raise UnsupportedSchema(f"additionalProperties {node.extra!r}")
        parts.append(f"{inner}[k: string]: {extra}")
    return "{\n" + _FIELDS.join(parts) + "\n" + indent + "}" if parts else "{}"


def _write_field(f: _Field, indent: str) -> str:
    """One field at `indent`: its comments and default above, then `name?: type` (no separator: the caller's)."""
    notes = _comments(f.type, indent)
    if f.default is not None:
        shown = repr(f.default) if isinstance(f.default, (int, float, bool)) else json.dumps(f.default,
                                                                                              ensure_ascii=False)
        notes += f"{indent}// Default: {shown}\n"
    return f"{notes}{indent}{f.name}{'?' if f.optional else ''}: {_write(f.type, indent)}"


def _function(function: dict[str, Any]) -> str:
    """One function: its `$defs` as interfaces, its description, `type NAME = (_: PARAMS) => any;`."""
    reg = _Registry()
    params = _object(function.get("parameters") or {}, reg)
    # Decided here, before the definitions are parsed, as the encoder does: a `$ref: "#"` met only inside `$defs`
    # (parsed below) prints `parameters` but neither declares it nor changes the signature.
    self_ref = reg.self_ref
    interfaces = []
    if self_ref:  # the parameters refer to themselves: they become a named interface (fields as listed)
        body = _FIELDS.join(_write_field(f, INDENT) for f in params.fields)
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in list(reg.definitions.items()):  # definitions met while writing these are not declared
        desc = schema.get("description", "")
        interfaces.append((_comment(desc, "") + "\n" if desc else "") + f"interface {name} "
                          + _write(_parse(schema, reg), ""))
    name = function.get("name", "function")
    signature = "parameters" if self_ref else _write(params, "")
    description = function.get("description")
    parts = ["\n".join(interfaces), _comment(description, "") if description else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)
