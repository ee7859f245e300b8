"""The API's front door: the checks its public functions and classes run on their arguments, before any work.

Each refusal is one line naming the Python parameter as the caller wrote it (``device=``), never a flag: a wrong
type a :class:`TypeError`, a wrong value a :class:`ValueError` (or one of vramcal's errors derived from it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


def shown(value: Any) -> str:
    """``value`` for a message: its type and a short repr (``str 'x'``, ``NoneType None``)."""
    return f"{type(value).__name__} {value!r:.40}"


def of_type(name: str, value: Any, types: type | tuple[type, ...], what: str, none: bool = False) -> Any:
    """``value`` when it is one of ``types`` (a bool only where ``bool`` is named; None where ``none``).

    Raises:
        TypeError: ``<name>= takes <what>, not <type> <value>``.
    """
    if value is None and none:
        return value
    named = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, named) or (isinstance(value, bool) and bool not in named):
        raise TypeError(f"{name}= takes {what}, not {shown(value)}")
    return value


def path_like(name: str, value: Any, what: str = "a folder's path", none: bool = False) -> Any:
    """``value`` when it is a ``str`` or an ``os.PathLike`` (or None where ``none``).

    Raises:
        TypeError: anything else.
    """
    return of_type(name, value, (str, os.PathLike), f"{what} (a str or a pathlib.Path)", none)


def flag(name: str, value: Any) -> bool:
    """``value`` when it is True or False.

    Raises:
        TypeError: anything else (``1``, ``"no"``).
    """
    return of_type(name, value, bool, "True or False")


def callback(name: str, value: Any, none: bool = True) -> Callable[..., Any] | None:
    """``value`` when it is callable (or None where ``none``).

    Raises:
        TypeError: anything else.
    """
    if (value is None and none) or callable(value):
        return value
    raise TypeError(f"{name}= takes a function{' or None' * none}, not {shown(value)}")


def mapping(name: str, value: Any, what: str, none: bool = True) -> Any:
    """``value`` when it is a mapping (a dict; or None where ``none``).

    Raises:
        TypeError: anything else (``"d_model=32"``).
    """
    return of_type(name, value, Mapping, what, none)


def name_text(name: str, value: Any, what: str) -> str:
    """``value`` when it is a non-empty ``str`` that is a Python identifier (an attribute's name).

    Raises:
        TypeError: no ``str``. ValueError: empty, or no identifier.
    """
    of_type(name, value, str, what)
    if not value.isidentifier():
        raise ValueError(f"{name}={value!r} is no attribute name: give {what}")
    return value
