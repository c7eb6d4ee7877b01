"""The config's text before the schema sees it: a YAML file (duplicate keys refused: PyYAML would keep the last
one silently) and dotted `key=value` overrides from the command line, merged into one plain dict that
eagle3.config validates as a whole.

    eagle3 train --config configs/smollm2-135m.yaml train.lr=3e-4 'target.aux_layer_ids=[2, 15, 27]'
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3.logs import UserError


class ConfigError(UserError, ValueError):
    """A config problem, already phrased for the user (dotted path + what is allowed)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            first = seen[key].start_mark.line + 1
            raise ConfigError(f"duplicate key {key!r} at line {line} (first set at line {first}); keep one")
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, source: str = "<config>") -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


_YAML11_WORDS = {"yes", "no", "on", "off", "y", "n"}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; the value is parsed as YAML (`3e-4`, `[2, 15, 27]`, `null`, `true`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected dotted key=value, e.g. train.lr=3e-4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        if raw.strip().lower() in _YAML11_WORDS:
            value: Any = raw.strip()  # `mixed_precision=no` means the word, not False
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                value = raw
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The field names allowed at the section that holds `loc` (for unknown-key messages)."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or ()
        candidates = [ann, *args]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return sorted(getattr(model, "model_fields", {}))


def validation_message(err: ValidationError, source: str, root: type[BaseModel]) -> str:
    """Pydantic's errors as the user reads them: one line per problem, its dotted path, and for an unknown key the
    keys allowed there (with the closest one as a guess)."""
    lines = [f"{source}: invalid config ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(root, loc) or []
            guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean {'.'.join(str(p) for p in loc[:-1] + (guess[0],))!r}?)" if guess else ""
            lines.append(f"  {path}: unknown key{hint}; allowed here: {', '.join(allowed)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {path}: {msg}{got_s}")
    return "\n".join(lines)
