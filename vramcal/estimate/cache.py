"""Traces kept on disk for every command that estimates: one per model, options, device kind, card traits, software and
this package's code (SHA-256), in ``$VRAMCAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/vramcal/traces``, else
``~/.cache/vramcal/traces``. An unreadable file is traced again; an unwritable one is not kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vramcal.environment import package_version
from vramcal.estimate.result import StepEstimate
from vramcal.estimate.step import estimate_step
from vramcal.files import atomic_write_json
from vramcal.records import Kind
from vramcal.workload import ModelRef

TRACE_SIZES = (8, 64)  # the batch sizes every estimate traces: a fake step costs the same at any size
SOFTWARE = ("vramcal", "torch", "transformers", "mamba-ssm", "causal-conv1d", "triton")


def folder() -> Path:
    """Where traces are kept (module docstring)."""
    if os.environ.get("VRAMCAL_CACHE_DIR"):
        return Path(os.environ["VRAMCAL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vramcal" / "traces"


def cached_trace(ref: ModelRef, options: dict[str, Any], kind: Kind = Kind.HOST, card: Any = None) -> StepEstimate:
    """The trace of ``ref`` at :data:`TRACE_SIZES` from the cache, else made and kept.

    Raises:
        What :func:`vramcal.estimate.step.estimate_step` raises (a failure is not kept).
    """
    path = folder() / f"{key(ref, options, kind, card)}.json"
    try:
        return StepEstimate.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    estimate = estimate_step(ref, TRACE_SIZES, options=options, device_kind=kind, card=card)
    try:
        atomic_write_json(path, estimate.to_dict())
    except OSError:
        pass
    return estimate


def key(ref: ModelRef, options: dict[str, Any], kind: Kind, card: Any) -> str:
    """24 hex digits of SHA-256 over what a trace depends on (module docstring)."""
    files = {name: _file(value) for name, value in options.items() if isinstance(value, str) and Path(value).is_file()}
    card_traits = None if card is None else [list(card.compute_capability), card.sm_count]  # not its name
    software = [package_version(name) for name in SOFTWARE]
    text = json.dumps([ref.to_dict(), options, files, kind, card_traits, software, _code()], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _code() -> str:
    """This package's code: a changed trace is a new key, whatever the version says."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join(path.read_bytes() for path in sorted(here.glob("*.py")))).hexdigest()


def _file(path: str) -> list[int]:
    stat = Path(path).stat()
    return [stat.st_size, stat.st_mtime_ns]
