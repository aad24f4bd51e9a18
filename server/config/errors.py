"""Config violations: one ``ConfigIssue`` per broken rule, all raised together in ``ConfigError``.

Operators fix a config in one pass only if every violation is reported at once, each with
the JSON path they must edit, the value we saw and what would be accepted.  Paths use
MindIE's key names: ``BackendConfig.ModelDeployConfig.ModelConfig[0].plugin_params``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import types
import typing
from typing import get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One violation.  ``related`` names other fields the rule read (for cross-field rules)."""
    path: str
    value: Any
    allowed: str
    message: str
    related: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"{self.path}: {self.message} (got {_show(self.value)}; allowed: {self.allowed})"

    def involves(self, path: str) -> bool:
        """True if this issue reads ``path`` or anything below it."""
        return any(_is_under(p, path) for p in (self.path, *self.related))


class ConfigError(ValueError):
    """The config is invalid; ``issues`` lists every violation found (never empty)."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.issues)} config violation(s){where}:"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))

    @property
    def errors(self) -> list[ConfigIssue]:
        """Alias of ``issues`` (the name docs/interfaces.md uses)."""
        return self.issues


def join_path(parts: Iterable[str | int]) -> str:
    """('A', 'B', 0, 'c') -> 'A.B[0].c'."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".") or path.startswith(root + "[")


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_TYPE_WORDS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
    "float_type": "a number", "model_type": "an object", "model_attributes_type": "an object",
    "dict_type": "an object", "tuple_type": "an array", "list_type": "an array",
    "missing": "a value (required)", "none_required": "null",
}


def _format_range(metadata: Sequence[Any]) -> str | None:
    lo = hi = None
    lo_open = hi_open = False
    for m in metadata:
        if getattr(m, "ge", None) is not None:
            lo = m.ge
        if getattr(m, "gt", None) is not None:
            lo, lo_open = m.gt, True
        if getattr(m, "le", None) is not None:
            hi = m.le
        if getattr(m, "lt", None) is not None:
            hi, hi_open = m.lt, True
    if lo is None and hi is None:
        return None
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi}"
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside ``X``, ``X | None`` or ``tuple[X, ...]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (typing.Union, types.UnionType, tuple, list):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def field_at(model: type[BaseModel], loc: Sequence[str | int]) -> FieldInfo | None:
    """The FieldInfo a pydantic error location points at (keys are aliases), or None."""
    info = None
    for part in loc:
        if isinstance(part, int):
            continue                      # tuple index: the element type is the same model
        if model is None:
            return None
        by_alias = {(f.alias or name): f for name, f in model.model_fields.items()}
        info = by_alias.get(part)
        if info is None:
            return None
        model = _model_in(info.annotation)
    return info


def issues_from_validation(err: ValidationError, root_model: type | None = None,
                           prefix: Sequence[str | int] = ()) -> list[ConfigIssue]:
    """Turn pydantic's errors into ConfigIssues with MindIE JSON paths.

    ``root_model`` lets range errors say the whole range ("[1024, 65535]") instead of one
    bound, by looking up the field's declared constraints along the error's location.
    """
    issues = []
    for e in err.errors(include_url=False):
        loc = tuple(prefix) + tuple(e["loc"])
        ctx = e.get("ctx") or {}
        kind = e["type"]
        if "allowed" in ctx:
            allowed = str(ctx["allowed"])
        elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            info = field_at(root_model, tuple(e["loc"])) if root_model else None
            allowed = (_format_range(info.metadata) if info else None) or e["msg"]
        elif kind == "literal_error":
            allowed = str(ctx.get("expected", e["msg"]))
        elif kind == "extra_forbidden":
            allowed = "no such key"
        else:
            allowed = _TYPE_WORDS.get(kind, e["msg"])
        message = e["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        value = "<redacted>" if "apiKeys" in loc else e.get("input")   # never echo a secret
        issues.append(ConfigIssue(join_path(loc), value, allowed, message))
    return issues
