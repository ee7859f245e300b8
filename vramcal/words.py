"""The words a message uses for a setting, the caller's own; and which notices inform and which warn.

A message names a setting as the caller gave it: ``--batch-size-min`` at the command line (each command runs
inside :func:`speaking` ``(FLAGS)``, a context variable), ``batch_size_min=`` to the API and the integrations.
A notice is a warning unless its maker marks it :class:`Info` (what was decided and why); a command prints a
warning after ``warning:`` (:func:`labelled`), the API sends it through :func:`warnings.warn`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

# setting -> the command line's flag
FLAGS = {"batch_size": "--batch-size", "batch_size_min": "--batch-size-min", "model": "--model",
         "params": "--model-arg", "implementation": "--impl", "seq_len": "--seq-len", "capacity": "--capacity",
         "gpu": "--gpu", "reserve": "--reserve", "margin": "--margin", "timeout": "--timeout",
         "effective_batch_size": "--effective-batch-size", "answer_batch_size": "--batch-size"}
# setting -> the API's argument (vramcal.api, the integrations: the same names throughout)
ARGUMENTS = {"batch_size": "request=", "batch_size_min": "batch_size_min=", "model": "model=",
             "params": "params=", "implementation": "implementation=", "seq_len": "seq_len=",
             "capacity": "capacity_bytes=", "gpu": "gpu=", "reserve": "LimitSettings(reserve_bytes=)",
             "margin": "LimitSettings(margin=)", "timeout": "TrialSettings(timeout_s=)",
             "effective_batch_size": "effective_batch_size=", "answer_batch_size": "batch_size="}

_SPOKEN: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("vramcal_words", default=ARGUMENTS)


def word(setting: str) -> str:
    """How the caller names ``setting`` (a key of :data:`FLAGS`): ``--batch-size-min`` or ``batch_size_min=``.

    Raises:
        KeyError: a setting with no word (a programming error).
    """
    return _SPOKEN.get()[setting]


def given(setting: str, value: object) -> str:
    """``setting`` with ``value`` as the caller writes it: ``--batch-size-min 8`` or ``batch_size_min=8``."""
    name = word(setting)
    return f"{name}{value}" if name.endswith("=") else f"{name} {value}"


class Info(str):
    """A notice that informs: a ``str`` whose maker marked it as information (module docstring); a plain ``str``
    notice is a warning."""

    __slots__ = ()


def labelled(notice: str) -> str:
    """A notice as a command prints it: :class:`Info` as it is, a warning after ``warning: ``."""
    return notice if isinstance(notice, Info) else f"warning: {notice}"


def is_info(notice: str) -> bool:
    """Whether ``notice`` informs (:class:`Info`) rather than warns."""
    return isinstance(notice, Info)


@contextlib.contextmanager
def speaking(words: Mapping[str, str]) -> Iterator[None]:
    """Messages made inside use ``words`` (:data:`FLAGS` for the command line)."""
    token = _SPOKEN.set(words)
    try:
        yield
    finally:
        _SPOKEN.reset(token)
