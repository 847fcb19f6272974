"""The result schema's rules: its version, and plain data checked against dataclass field types.

Trial records, verdicts and winners files (records.py, results.py) are dataclasses stored as
JSON. `from_dict` checks every field against its declared type and raises `SchemaError` naming
the field; versioned data carries `"schema": SCHEMA_VERSION`, data without it is version 1 and is
migrated, data from a newer fusionlab is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any, ClassVar, TypeVar, Union

from fusionlab.errors import UserError

SCHEMA_VERSION = 2
"""1: data written before the schema had a version (no "schema" key; verdicts without a
"decision", winners files with display text for numbers). 2: typed, validated data."""

T = TypeVar("T")
_NAMES = {float: "a number", int: "an integer", str: "a string", bool: "true or false",
          list: "a list", tuple: "a list", dict: "an object", type(None): "null"}


class SchemaError(ValueError):
    """Data that does not fit the schema; the message names the field and what was found."""


@contextmanager
def user_facing(where: str) -> Iterator[None]:
    """Turn a SchemaError into the one-line UserError of the command line and the Dispatcher."""
    try:
        yield
    except SchemaError as error:
        raise UserError(f"{where}: {error}") from None


def _found(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{_NAMES.get(type(value), type(value).__name__)} {shown}"


def _fail(path: str, expected: str, value: Any) -> SchemaError:
    return SchemaError(f"field {path!r} should be {expected}, found {_found(value)}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse(cls: type[T], data: Any, where: str = "", strict: bool = True) -> T:
    """An instance of dataclass `cls` from plain data, every field checked against its type.
    Unknown fields are refused when `strict` (data of this version), else dropped."""
    if not isinstance(data, dict):
        if where:
            raise _fail(where, "an object", data)
        raise SchemaError(f"{cls.__name__} should be an object, found {_found(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if strict and unknown:
        raise SchemaError(f"field {_join(where, unknown[0])!r} is not part of schema "
                          f"{SCHEMA_VERSION}")
    values, hints = {}, _hints(cls)
    for name, field in fields.items():
        path = _join(where, name)
        if name in data:
            values[name] = _value(hints[name], data[name], path, strict)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(f"field {path!r} is missing")
    return cls(**values)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _value(kind: Any, value: Any, path: str, strict: bool) -> Any:
    """`value` checked against the type `kind`, as that type (nested dataclasses parsed)."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        return _optional(kind, value, path, strict)
    if origin in (list, tuple):
        return _sequence(kind, value, path, strict)
    if origin is dict:
        return _mapping(kind, value, path, strict)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return _member(kind, value, path)
    if dataclasses.is_dataclass(kind):
        return parse(kind, value, path, strict)  # type: ignore[arg-type]
    return _scalar(kind, value, path)


def _optional(kind: Any, value: Any, path: str, strict: bool) -> Any:
    """Only `X | None` in this schema."""
    args = typing.get_args(kind)
    if value is None and type(None) in args:
        return None
    (inner,) = [a for a in args if a is not type(None)]
    return _value(inner, value, path, strict)


def _sequence(kind: Any, value: Any, path: str, strict: bool) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _fail(path, "a list", value)
    item = typing.get_args(kind)[0]
    items = [_value(item, v, f"{path}[{i}]", strict) for i, v in enumerate(value)]
    return items if typing.get_origin(kind) is list else tuple(items)


def _mapping(kind: Any, value: Any, path: str, strict: bool) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(path, "an object", value)
    item = typing.get_args(kind)[1]
    return {k: _value(item, v, f"{path}.{k}", strict) for k, v in value.items()}


def _member(kind: type[Enum], value: Any, path: str) -> Enum:
    try:
        return kind(value)
    except (ValueError, TypeError):
        choices = ", ".join(repr(m.value) for m in kind)
        raise _fail(path, f"one of {choices}", value) from None


def _scalar(kind: Any, value: Any, path: str) -> Any:
    """A number, string or bool: a bool is never a number, an integer is a float."""
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind in (int, str, bool) and isinstance(value, kind) and (
        kind is bool or not isinstance(value, bool)
    ):
        return value
    raise _fail(path, _NAMES.get(kind, str(kind)), value)


def plain(value: Any) -> Any:
    """Dataclasses, enums and tuples as JSON's objects, strings and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def version_of(data: Any, noun: str, key: str = "schema") -> int:
    """The schema version `data` was written with (1 when it names none); newer is refused."""
    if not isinstance(data, dict):
        raise SchemaError(f"{noun} should be an object, found {_found(data)}")
    version = data.get(key, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise SchemaError(f"{noun}: {_fail(key, 'a positive integer', version)}")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{noun} written by a newer fusionlab (schema {version}); upgrade fusionlab"
        )
    return version


class Stored:
    """A dataclass kept as plain data: `to_dict`, and `from_dict` checked against its types."""

    def to_dict(self) -> dict[str, Any]:
        return plain(self)

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        return parse(cls, data)


class Versioned(Stored):
    """Top-level stored data: it carries the schema version, and older data is migrated."""

    noun: ClassVar[str] = "data"

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, **plain(self)}

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        noun = cls.noun  # type: ignore[attr-defined]
        version = version_of(data, noun)
        fields = {k: v for k, v in data.items() if k != "schema"}
        try:
            if version < SCHEMA_VERSION:
                return parse(cls, cls.migrate(fields), strict=False)  # type: ignore[attr-defined]
            return parse(cls, fields)
        except SchemaError as error:
            raise SchemaError(f"{noun}: {error}") from None

    @classmethod
    def migrate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Version 1 data as this version's fields (fields no longer read are dropped)."""
        return data
