"""The words a message uses for a setting: the caller's own.

A message that tells people which setting to change names it as they gave it: ``--batch-size-min`` to
someone at the command line, ``batch_size_min=`` to someone calling :func:`vramcal.api.batch_size`, the
Lightning callback or :class:`vramcal.integrations.run.FrameworkRun` (issue 23: the API and the callbacks
once named CLI flags). The library speaks the API's argument names; each command of the CLI runs inside
:func:`speaking` ``(FLAGS)`` (:func:`vramcal.cli.main`), a context variable, so a message made anywhere below
it (sizing, the families) reads the flags, and one made for the API, in the same process afterwards, does
not.
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


@contextlib.contextmanager
def speaking(words: Mapping[str, str]) -> Iterator[None]:
    """Messages made inside use ``words`` (:data:`FLAGS` for the command line)."""
    token = _SPOKEN.set(words)
    try:
        yield
    finally:
        _SPOKEN.reset(token)
