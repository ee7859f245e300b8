"""The one formatter and the one parser of byte counts (binary units: 1 GiB = 2**30 bytes), and the one
formatter of durations."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def format_bytes(n_bytes: int | float) -> str:
    """Render a byte count for people, e.g. ``8858370048 -> '8.25 GiB'``.

    Args:
        n_bytes: a count of bytes (may be negative, e.g. a difference).

    Returns:
        The count in the largest binary unit (B, KiB, MiB, GiB, TiB) that keeps it at least 1,
        with two decimals (none for plain bytes).
    """
    sign = "-" if n_bytes < 0 else ""
    value = float(abs(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"


def parse_bytes(text: str) -> int:
    """Parse a size such as ``'12GiB'``, ``'12 GB'``, ``'512MiB'`` or ``'1073741824'`` into bytes.

    Binary suffixes (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; decimal ones
    (KB, MB, GB, TB) are powers of 1000, as in the SI/IEC convention.

    Raises:
        ValueError: the text is not a non-negative number with a known unit; the message lists the units.
    """
    match = _PATTERN.match(str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write a number with a unit such as 12GiB, "
                         f"512MiB or 16GB")
    return int(float(match.group(1)) * _UNITS[unit])


def size_argument(n_bytes: int) -> str:
    """``n_bytes`` as a command line takes it back exactly: ``1.50GiB`` when that reads back as ``n_bytes``
    (:func:`parse_bytes`), else the byte count (``1706382678``)."""
    text = format_bytes(n_bytes).replace(" ", "")
    return text if parse_bytes(text) == n_bytes else str(int(n_bytes))


def format_rate(samples_per_s: float) -> str:
    """Samples per second for people: three significant digits below 100 (``8.71``, ``95.7``), whole numbers with
    thousands separators from 100 (``957``, ``2,090``), never ``2.09e+03``."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def format_duration(seconds: float, like: float | None = None) -> str:
    """Render a duration for people with three significant digits: ``0.84 s``, ``130 s``, ``11.8 min``,
    ``9.88 h``; seconds up to 10 minutes, minutes up to 3 hours, then hours. ``like``: take the unit ``like``
    seconds would take (an interval's ends in its value's unit: ``10.4 min (9.52 min–11.4 min)``, not ``571 s``)."""
    unit = seconds if like is None else like
    if unit < 600:
        return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"
    if unit < 3 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h" if seconds < 100 * 3600 else f"{seconds / 3600:,.0f} h"
