"""`--config NAME=VALUE,...`: each value typed from the config class's fields (or a factory's
parameters); a name the target does not have is an error, not silently ignored."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from fusionlab.errors import UserError

# A comma starts a new item only before `NAME=`, so a JSON list value may hold commas.
_ITEM_BREAK = re.compile(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)")
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
_NONE = ("none", "null")
_EXAMPLE = "e.g. hidden_size=1024,rms_norm_eps=1e-6,tie_word_embeddings=false"


def split_items(text: str | None) -> dict[str, str]:
    """`hidden_size=1024,rms_norm_eps=1e-6` -> {name: value text}, in order."""
    items: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in _ITEM_BREAK.split(text or ""))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UserError(f"--config {item!r}: write NAME=VALUE, {_EXAMPLE}")
        items[name.strip()] = value.strip()
    return items


def config_fields(config_class: type) -> dict[str, Any]:
    """The settable names of a transformers config class and their types (aliases included)."""
    if dataclasses.is_dataclass(config_class):
        fields = {f.name: _resolved(f.type, config_class) for f in dataclasses.fields(config_class)}
    else:
        fields = factory_parameters(config_class.__init__)[0]
    for alias, name in getattr(config_class, "attribute_map", {}).items():
        if name in fields:
            fields[alias] = fields[name]
    return fields


def _resolved(annotation: Any, owner: type) -> Any:
    """A field's type; a string annotation evaluated in its class's module (Any if it fails)."""
    if not isinstance(annotation, str):
        return annotation
    import torch

    namespace = {**vars(typing), **vars(sys.modules[owner.__module__]), "torch": torch}
    try:
        return eval(annotation, namespace)
    except Exception:  # an annotation that does not resolve here: read the value as it comes
        return Any


def factory_parameters(function: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """A function's keyword parameters and their types, and whether it takes **kwargs."""
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # annotations that do not resolve: fall back to the defaults' types
        hints = {}
    fields: dict[str, Any] = {}
    open_ended = False
    for name, parameter in signature.parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            open_ended = True
        elif parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and (
            name != "self"
        ):
            default = parameter.default
            fields[name] = hints.get(name, Any if default in (parameter.empty, None)
                                     else type(default))
    return fields, open_ended


def typed_overrides(raw: dict[str, str], fields: dict[str, Any], target: str,
                    open_ended: bool = False) -> dict[str, Any]:
    """Each value converted to its field's type; an unknown name is refused (with a suggestion)
    unless the target takes any keyword (`open_ended`)."""
    if not open_ended:
        check_known(raw, fields, target)
    return {name: typed_value(name, text, fields.get(name, Any)) for name, text in raw.items()}


def check_known(names: Iterable[str], fields: dict[str, Any], target: str) -> None:
    """Refuse a setting the target does not have, naming the closest one it has."""
    for name in names:
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"did you mean {close[0]}?" if close else "check the spelling"
            raise UserError(f"--config {name}: {target} has no setting {name!r} ({hint})")


def typed_value(name: str, text: str, annotation: Any) -> Any:
    """`text` as the first type of `annotation` it reads as (None, bool, int, float, str,
    a Literal's choices, or a JSON list/dict)."""
    options = _options(annotation)
    if type(None) in options and text.lower() in _NONE:
        return None
    for option in options:
        value = _as(option, text)
        if value is not _NO:
            return value
    raise UserError(f"--config {name}={text}: {name} takes {_describe(options)}")


_NO = object()


def _options(annotation: Any) -> tuple[Any, ...]:
    if annotation is Any:
        return (int, float, bool, type(None), str)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(o for a in typing.get_args(annotation) for o in _options(a))
    return (annotation,)


def _as(option: Any, text: str) -> Any:
    origin = typing.get_origin(option)
    if origin is typing.Literal:
        return text if text in [str(choice) for choice in typing.get_args(option)] else _NO
    if option is bool:
        lowered = text.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else _NO
    if option is int:
        try:
            return int(text)
        except ValueError:
            return _NO
    if option is float:
        try:
            return float(text)
        except ValueError:
            return _NO
    if option is str:
        return text
    if option in (list, dict) or origin in (list, dict):
        try:
            value = json.loads(text)
        except ValueError:
            return _NO
        return value if isinstance(value, origin or option) else _NO
    return _NO


def _describe(options: tuple[Any, ...]) -> str:
    names = []
    for option in options:
        origin = typing.get_origin(option)
        if origin is typing.Literal:
            names.append("one of " + ", ".join(str(c) for c in typing.get_args(option)))
        elif option is type(None):
            names.append("none")
        elif origin in (list, dict) or option in (list, dict):
            names.append(f"a JSON {(origin or option).__name__}")
        else:
            names.append(getattr(option, "__name__", str(option)))
    text = " or ".join(dict.fromkeys(names))
    if not any(_settable(option) for option in options):
        text += ", which cannot be given on the command line"
    return text


def _settable(option: Any) -> bool:
    origin = typing.get_origin(option)
    return origin in (typing.Literal, list, dict) or option in (
        bool, int, float, str, list, dict, type(None)
    )
