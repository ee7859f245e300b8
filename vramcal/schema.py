"""Checked reading of the JSON and TOML vramcal reads: a dict into a frozen dataclass, every field typed and ranged.

Types come from the dataclass's annotations, ranges from a table beside it; each refusal is one :class:`SchemaError`
line naming the field's path (``trials[3].peak_bytes``). Refused beyond JSON's own rules: a bool for a number, a
fraction for a whole number, a quoted number, NaN, infinities, magnitudes beyond :data:`MAX_MAGNITUDE` and nesting
deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

MAX_MAGNITUDE = 2**63  # no byte count, batch size or statistic vramcal records comes near it
MAX_DEPTH = 32  # levels of nesting below a free-form (``Any``) field
_TEXT_LENGTH = 60


class SchemaError(ValueError):
    """A value that does not fit its field: ``field`` is its path, the message the whole line."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Range:
    """The values a number may take: ``low``/``high`` bounds (None: unbounded), open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1]``, ``in (0, 1]``."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"{'<' if self.high_open else '<='} {_number(self.high)}"


POSITIVE = Range(0, low_open=True)  # > 0
AT_LEAST_ONE = Range(1)  # >= 1
NON_NEGATIVE = Range(0)  # >= 0
FRACTION = Range(0, 1)  # in [0, 1]

Reader = Callable[[Any, str], Any]  # (value, path) -> the field's value; raises SchemaError


def shown(value: Any) -> str:
    """``value`` as a short one-line repr for messages (long values are cut with ``...``)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    text = repr(value) if not isinstance(value, (dict, list)) else _json_text(value)
    text = " ".join(text.split())
    return text if len(text) <= _TEXT_LENGTH else text[:_TEXT_LENGTH - 3] + "..."


def kind(value: Any) -> str:
    """What a JSON value is, in words: ``a string``, ``a whole number``, ``null``, ``a list``, ..."""
    if value is None:
        return "null"
    words = ((bool, "true/false"), (int, "a whole number"), (float, "a number"), (str, "a string"),
             ((list, tuple), "a list"), (dict, "an object"))
    return next((word for types_, word in words if isinstance(value, types_)), type(value).__name__)


def read_record(cls: type, data: Any, where: str, ranges: Mapping[str, Range] | None = None,
                readers: Mapping[str, Reader] | None = None, optional: tuple[str, ...] = ()) -> Any:
    """``cls(**data)`` once every field of ``data`` fits ``cls``'s annotations and ``ranges``.

    Args:
        where: the record's path for messages (``fit``, ``trials[2]``, ``config``).
        ranges: field name -> the range a number (or each number of a tuple) must lie in.
        readers: field name -> a reader for a nested record (``(value, path) -> value``).
        optional: fields that may be missing although they have no default (``cls`` then fails itself).

    Raises:
        SchemaError: not an object, an unknown or missing field, a value that does not fit, or one ``cls`` refuses.
    """
    if not isinstance(data, dict):
        raise SchemaError(where, f"{where} is {kind(data)}, not an object of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise SchemaError(_join(where, unknown[0]), f"{_join(where, unknown[0])} is not a field of {cls.__name__}: "
                                                   f"remove it (the fields are {', '.join(fields)})")
    missing = [name for name, f in fields.items() if name not in data and name not in optional
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SchemaError(_join(where, missing[0]), f"{_join(where, missing[0])} is missing")
    hints, ranges, readers = typing.get_type_hints(cls), ranges or {}, readers or {}
    values = {}
    for name, value in data.items():
        path = _join(where, name)
        values[name] = (readers[name](value, path) if name in readers
                        else read_value(value, hints[name], path, ranges.get(name)))
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:
        raise SchemaError(where, f"{where}: {error}") from None


class Record:
    """A frozen dataclass as JSON holds it: :meth:`to_dict` (tuples as lists, nested ones too), :meth:`from_dict`
    checked against its annotations, ``RANGES`` and the ``READERS`` of its nested records (:func:`read_record`),
    named ``WHERE`` in messages (default: the class's name in lower case)."""

    WHERE: ClassVar[str | None] = None
    RANGES: ClassVar[Mapping[str, Range]] = {}
    READERS: ClassVar[Mapping[str, Reader]] = {}

    def to_dict(self) -> dict[str, Any]:
        return _lists(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str | None = None) -> Self:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where or cls.WHERE or cls.__name__.lower(), cls.RANGES, cls.READERS)


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    return [_lists(item) for item in value] if isinstance(value, tuple | list) else value


def _not(path: str, value: Any, what: str) -> SchemaError:
    if value is None:
        return SchemaError(path, f"{path} is null, not {what}")
    return SchemaError(path, f"{path} = {shown(value)} is {kind(value)}, not {what}")


def read_value(value: Any, hint: Any, path: str, limits: Range | None = None) -> Any:
    """``value`` checked against the type ``hint`` (each number against ``limits``); lists read as tuples, whole
    numbers as floats where the hint says so. Raises: SchemaError: the value does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return plain(value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = [arg for arg in args if arg is not type(None)]
        if len(choices) == 1:
            return read_value(value, choices[0], path, limits)
        for arg in choices:
            try:
                return read_value(value, arg, path, limits)
            except SchemaError:
                continue
        raise _not(path, value, hint_text(hint))
    if origin is typing.Literal or isinstance(hint, enum.EnumType):
        names = args if origin is typing.Literal else tuple(member.value for member in hint)
        if isinstance(value, bool) or value not in names:
            raise SchemaError(path, f"{path} = {shown(value)} is not one of {', '.join(map(repr, names))}")
        return value if origin is typing.Literal else hint(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _not(path, value, "a list")
        return tuple(read_value(v, args[0], f"{path}[{i}]", limits) for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _not(path, value, "an object")
        return plain(value, path)
    if hint in (int, float):
        return read_number(value, path, hint, limits)
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise _not(path, value, hint_text(hint))
        return value
    if isinstance(value, hint):
        return value
    raise _not(path, value, hint_text(hint))


def read_number(value: Any, path: str, hint: type = float, limits: Range | None = None) -> int | float:
    """A finite number of type ``hint`` within ``limits`` and :data:`MAX_MAGNITUDE`.
    Raises: SchemaError: no number (a string, bool, null), a fraction for an int, not finite, or out of range."""
    name = "a whole number" if hint is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint_quotes = " (write it without quotes)" if isinstance(value, str) and _numeric(value) else ""
        raise _not(path, value, name + hint_quotes)
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(path, f"{path} = {shown(value)} is not a finite number")
    if abs(value) >= MAX_MAGNITUDE:
        raise SchemaError(path, f"{path} = {shown(value)} is out of range (beyond ±2^63)")
    if hint is int and not isinstance(value, int):
        raise SchemaError(path, f"{path} = {shown(value)} is not a whole number")
    if limits is not None and not limits.holds(value):
        raise SchemaError(path, f"{path} = {shown(value)} is not {limits.text()}")
    return float(value) if hint is float else value


def plain(value: Any, path: str, depth: int = 0) -> Any:
    """A free-form JSON value, its numbers finite and within :data:`MAX_MAGNITUDE`, nested at most :data:`MAX_DEPTH`.
    Raises: SchemaError: a non-finite or out-of-range number, a non-JSON value, or nesting too deep."""
    if depth > MAX_DEPTH:
        raise SchemaError(path, f"{path} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        return {str(k): plain(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return read_number(value, path, type(value))
    if value is None or isinstance(value, (str, bool)):
        return value
    raise SchemaError(path, f"{path} = {shown(value)} is not a JSON value")


def read_list(value: Any, path: str, read: Reader) -> tuple[Any, ...]:
    """A list whose items ``read`` checks. Raises: SchemaError: not a list, or an item ``read`` refuses."""
    if not isinstance(value, list):
        raise _not(path, value, "a list")
    return tuple(read(item, f"{path}[{i}]") for i, item in enumerate(value))


def read_map(value: Any, path: str, read: Reader, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """An object whose values ``read`` checks, keys among ``keys`` (None: any).
    Raises: SchemaError: not an object, an unknown key, or a value ``read`` refuses."""
    if not isinstance(value, dict):
        raise _not(path, value, "an object")
    for key in value:
        if keys is not None and key not in keys:
            raise SchemaError(f"{path}.{key}", f"{path}.{key} is not one of {', '.join(keys)}: remove it")
    return {key: read(item, f"{path}.{key}") for key, item in value.items()}


def hint_text(hint: Any) -> str:
    """A type annotation in words: ``a whole number``, ``a string or null``, ``a list of numbers``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = [hint_text(a) for a in args if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is typing.Literal or isinstance(hint, enum.EnumType):
        return "one of " + ", ".join(map(repr, args if origin is typing.Literal else [m.value for m in hint]))
    if origin is tuple:
        return f"a list of {hint_text(args[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", dict: "an object"}
    return names.get(hint) or names.get(origin) or f"a {getattr(hint, '__name__', hint)}"


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _number(value: float) -> str:
    return f"{int(value)}" if float(value).is_integer() else f"{value:g}"


def _numeric(text: str) -> bool:
    try:
        return float(text) is not None
    except ValueError:
        return False


def _json_text(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return f"<{kind(value)}>"
