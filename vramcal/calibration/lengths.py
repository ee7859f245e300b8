"""Sizing for lengths that vary: the bucket table and the token budget of a profile's surface, read from its
2-D model through :func:`~vramcal.calibration.surface.answer_at`.

**Padding.** Mamba-2's chunked scan pads a sequence to a multiple of ``chunk_size`` (transformers 5.25,
``models/mamba2/modeling_mamba2.py``, ``mamba2_chunk_scan``: ``pad_size = (chunk_size - sequence_length %
chunk_size) % chunk_size``; mamba_ssm's ``mamba_chunk_scan_combined`` computes whole chunks too), so a batch whose
longest document has L tokens is sized at ``padded_length(L)``, at least the shortest calibrated length.

**Bucket table** (:func:`bucket_table`): bucket i holds ``(b_{i-1}, b_i]`` at the safe batch of
``padded_length(b_i)``. **Token budget** (:func:`token_budget`): the largest T with ``floor(T / L) <= B`` (the
safe batch at ``padded_length(L)``) for every L in the range::

    floor(T / L) <= B  <=>  T <= L × (B + 1) - 1,   so   T = min over L of L × (B(padded_length(L)) + 1) - 1.

B is constant over a chunk and ``L × (B + 1)`` grows with L, so the minimum over each chunk's shortest length
(:func:`worst_lengths`) is exact; where it is reached (the **worst length**) the budget is verified by a trial.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.creep import steady_equivalent
from vramcal.calibration.search import SearchSettings, Step, memory_failure, unmeasured
from vramcal.calibration.surface import Surface, answer_at
from vramcal.records import Trial
from vramcal.schema import AT_LEAST_ONE, NON_NEGATIVE, Record, read_list, read_map, read_record


def padded_length(seq_len: int, chunk_size: int) -> int:
    """``seq_len`` rounded up to a multiple of ``chunk_size`` (tokens): what the chunked scan computes on."""
    return -(-seq_len // chunk_size) * chunk_size


def parse_buckets(text: str) -> tuple[int, ...]:
    """Read ``--buckets``: ``"128,256,512,1024"`` (each bucket's longest length), sorted, de-duplicated; ``"auto"``
    is () (:func:`default_buckets` chooses).

    Raises:
        ValueError: empty text, a value that is no whole number, or a boundary below 1.
    """
    text = text.strip()
    if text == "auto":
        return ()
    parts = [part.strip() for part in text.split(",")] if text else []
    if not parts or any(not re.fullmatch(r"[+-]?\d+", part) for part in parts):
        raise ValueError(f"cannot read the buckets {text!r}: write their longest lengths, e.g. 128,256,512,1024, "
                         f"or auto")
    if min(int(part) for part in parts) < 1:
        raise ValueError(f"a bucket's longest length must be positive: got {text}")
    return tuple(sorted({int(part) for part in parts}))


def default_buckets(surface: Surface) -> tuple[int, ...]:
    """Boundaries chosen from a surface: its calibrated lengths and the powers of two between them."""
    low, high = min(surface.seq_lens), max(surface.seq_lens)
    powers = {2**k for k in range(low.bit_length(), high.bit_length()) if low < 2**k < high}
    return tuple(sorted(set(surface.seq_lens) | powers))


@dataclass(frozen=True)
class Bucket(Record):
    """One row of a bucket table: lengths in [``shortest_seq_len``, ``longest_seq_len``] (tokens), sized at
    ``padded_seq_len`` (module docstring), with the safe and conservative batch and their ``basis``
    (:func:`~vramcal.calibration.surface.answer_at`)."""

    shortest_seq_len: int
    longest_seq_len: int
    padded_seq_len: int
    safe_batch_size: int
    conservative_batch_size: int
    basis: str

    WHERE = "lengths.buckets[0]"
    RANGES = {**dict.fromkeys(("shortest_seq_len", "longest_seq_len", "padded_seq_len"), AT_LEAST_ONE),
              "safe_batch_size": NON_NEGATIVE, "conservative_batch_size": NON_NEGATIVE}


def _sized_at(surface: Surface, seq_len: int) -> int:
    return max(padded_length(seq_len, surface.chunk_size), min(surface.seq_lens))


def bucket_table(surface: Surface, boundaries: Sequence[int], usable_bytes: int,
                 conservative_fraction: float) -> tuple[Bucket, ...]:
    """The safe and conservative batch of each bucket (module docstring), shortest bucket first.

    Args:
        boundaries: each bucket's longest length (tokens), any order; () chooses (:func:`default_buckets`).
        usable_bytes, conservative_fraction: the profile's (:class:`~vramcal.calibration.limits.LimitSettings`).

    Raises:
        ValueError: a boundary below 1, or above the profile's longest calibrated length.
    """
    ends = sorted(set(boundaries)) or list(default_buckets(surface))
    if ends[0] < 1:
        raise ValueError(f"a bucket's longest length must be positive: got {ends[0]}")
    low, high = min(surface.seq_lens), max(surface.seq_lens)
    if ends[-1] > high:
        raise ValueError(f"the bucket {ends[-1]} is longer than the profile's longest seq_len {high}: calibrate up to "
                         f"it (vramcal probe --seq-len {low}:{padded_length(ends[-1], surface.chunk_size)}) or end at "
                         f"{high}")
    rows, shortest = [], 1
    for longest in ends:
        at = _sized_at(surface, longest)
        safe, conservative, basis = answer_at(surface, at, usable_bytes, conservative_fraction)
        rows.append(Bucket(shortest, longest, at, safe, conservative, basis))
        shortest = longest + 1
    return tuple(rows)


def bucket_of(table: Sequence[Bucket], seq_len: int) -> Bucket:
    """The bucket that holds a document of ``seq_len`` tokens.

    Raises:
        ValueError: a length no bucket covers (above the longest bucket, or below 1).
    """
    for bucket in table:
        if bucket.shortest_seq_len <= seq_len <= bucket.longest_seq_len:
            return bucket
    raise ValueError(f"no bucket covers a document of {seq_len} tokens: the buckets hold 1-{table[-1].longest_seq_len}"
                     f"; add a bucket up to it (within the profile's range) or cut the document")


@dataclass(frozen=True)
class TokenBudget(Record):
    """The most tokens per batch over a range of lengths (module docstring): the safe and conservative ``tokens``
    (unpadded), the range [``shortest_seq_len``, ``longest_seq_len``], the model's ``chunk_size``, and each
    budget's worst length (unpadded: where its batch sits closest to its limit, the one verified)."""

    tokens: int
    conservative_tokens: int
    shortest_seq_len: int
    longest_seq_len: int
    chunk_size: int
    worst_seq_len: int
    conservative_worst_seq_len: int

    def batch_size(self, seq_len: int, conservative: bool = False) -> int:
        """Documents per batch when the longest of them has ``seq_len`` tokens: ``floor(tokens / max(seq_len,
        shortest_seq_len))``.

        Raises:
            ValueError: ``seq_len`` above the budget's range (a document longer than the profile's longest seq_len).
        """
        if seq_len > self.longest_seq_len:
            raise ValueError(f"a document of {seq_len} tokens is longer than the profile's longest seq_len "
                             f"{self.longest_seq_len}: cut it (or calibrate longer lengths: vramcal probe --seq-len "
                             f"{self.shortest_seq_len}:{padded_length(seq_len, self.chunk_size)})")
        return (self.conservative_tokens if conservative else self.tokens) // max(seq_len, self.shortest_seq_len)

    def worst(self, conservative: bool = False) -> tuple[int, int]:
        """(padded seq_len, batch_size) of the budget's verification: its worst batch."""
        length = self.conservative_worst_seq_len if conservative else self.worst_seq_len
        return padded_length(max(length, self.shortest_seq_len), self.chunk_size), self.batch_size(length, conservative)

    @classmethod
    def from_dict(cls, data: dict, where: str = "lengths.budget") -> TokenBudget:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where, dict.fromkeys([f.name for f in dataclasses.fields(cls)], AT_LEAST_ONE))


def worst_lengths(low: int, high: int, chunk_size: int) -> list[int]:
    """``low`` and each chunk's shortest length above it up to ``high`` (module docstring)."""
    firsts = range(padded_length(low, chunk_size) + 1, high + 1, chunk_size)
    return [low, *firsts]


def token_budget(surface: Surface, usable_bytes: int, conservative_fraction: float,
                 failed: Sequence[tuple[int, int]] = ()) -> TokenBudget:
    """The token budget over the surface's calibrated range (module docstring); ``failed``: (padded seq_len,
    batch_size) pairs that did not fit, capping the batch at that length and longer ones.

    Raises:
        ValueError: one document of the longest length does not fit (no budget holds the range).
    """
    low, high, chunk = min(surface.seq_lens), max(surface.seq_lens), surface.chunk_size
    limits: dict[int, tuple[int, int]] = {}
    for length in worst_lengths(low, high, chunk):
        at = _sized_at(surface, length)
        if at not in limits:
            safe, conservative, _ = answer_at(surface, at, usable_bytes, conservative_fraction)
            cap = min((b - 1 for n, b in failed if n <= at), default=safe)
            safe = min(safe, cap)
            limits[at] = (safe, min(conservative, math.floor(conservative_fraction * safe)))
    if min(safe for safe, _ in limits.values()) < 1:
        raise ValueError(f"one document of {high} tokens does not fit in usable memory: no token budget holds the "
                         f"range {low}-{high}; use buckets (vramcal limits --buckets) or a larger budget")

    def least(which: int) -> tuple[int, int]:
        bound = [(length * (limits[_sized_at(surface, length)][which] + 1) - 1, length)
                 for length in worst_lengths(low, high, chunk)]
        return min(bound, key=lambda item: (item[0], item[1] - _sized_at(surface, item[1])))

    (tokens, worst), (conservative_tokens, conservative_worst) = least(0), least(1)
    return TokenBudget(tokens, max(1, conservative_tokens), low, high, chunk, worst, conservative_worst)


# ------------------------------------------------------------------------------------ verification

BUDGET, CONSERVATIVE_BUDGET = "verify-budget", "verify-budget-conservative"  # the budget's verification trials
PURPOSES = (BUDGET, CONSERVATIVE_BUDGET)
MAX_CHECKS = 6  # verification trials of the budget at most (a failure lowers it and moves its worst length)


@dataclass(frozen=True)
class LengthCheck(Record):
    """The trial behind a bucket table's or a budget's worst case, ``passed`` when its peak (creep included) fit."""

    seq_len: int
    batch_size: int
    passed: bool
    peak_bytes: int | None

    WHERE = "lengths.verification"
    RANGES = dict.fromkeys(("seq_len", "batch_size", "peak_bytes"), AT_LEAST_ONE)


@dataclass(frozen=True)
class LengthSizing(Record):
    """What a calibration over several lengths says about lengths that vary (the profile's ``lengths``): the
    ``buckets`` at :func:`default_buckets`, the ``budget`` (None, with a ``note``: one document of the longest length
    does not fit), the ``verification`` of ``buckets``, ``budget`` and ``conservative_budget`` where a trial ran, and
    the budget's ``trials`` as measured."""

    buckets: tuple[Bucket, ...]
    budget: TokenBudget | None
    verification: dict[str, LengthCheck]
    trials: tuple[Trial, ...] = ()
    note: str | None = None

    @property
    def verified(self) -> bool:
        """The longest bucket and both budgets ran for real within usable memory at their worst case."""
        names = ("buckets", "budget", "conservative_budget") if self.budget else ("buckets",)
        return all(name in self.verification and self.verification[name].passed for name in names)

    WHERE = "lengths"
    READERS = {"buckets": lambda value, path: read_list(value, path, Bucket.from_dict),
               "budget": lambda value, path: None if value is None else TokenBudget.from_dict(value, path),
               "verification": lambda value, path: read_map(value, path, LengthCheck.from_dict,
                                                            ("buckets", "budget", "conservative_budget")),
               "trials": lambda value, path: read_list(value, path, Trial.from_dict)}


def _read(core: Sequence[Trial], checks: Sequence[Trial]) -> list[Trial]:
    """Every trial with a length, steady-equivalent (a search trial at a worst batch verifies it as a check does)."""
    return [t for t in steady_equivalent([*core, *checks]) if t.seq_len is not None]


def _budget(surface: Surface, checks: Sequence[Trial], settings: SearchSettings) -> TokenBudget | None:
    failed = [(t.seq_len, t.batch_size) for t in checks if t.seq_len and memory_failure(t, settings.usable_bytes)]
    try:
        return token_budget(surface, settings.usable_bytes, settings.limits.conservative_fraction, failed)
    except ValueError:
        return None


def next_check(core: Sequence[Trial], checks: Sequence[Trial], surface: Surface,
               settings: SearchSettings) -> tuple[int, Step] | None:
    """The next verification of the token budgets at their worst batch, (padded seq_len, step), or None when both
    are verified or cannot be (no budget, :data:`MAX_CHECKS` spent, a batch unmeasured twice). ``core``: the
    calibration's trials; ``checks``: the budget's (:data:`PURPOSES`). A failure lowers the budget and moves it."""
    if len(checks) >= MAX_CHECKS:
        return None
    read = _read(core, checks)
    budget = _budget(surface, read, settings)
    if budget is None:
        return None
    for conservative, purpose in ((False, BUDGET), (True, CONSERVATIVE_BUDGET)):
        length, batch = budget.worst(conservative)
        here = [t for t in read if (t.seq_len, t.batch_size) == (length, batch)]
        if batch < 1 or any(t.fits(settings.usable_bytes) for t in here) or sum(map(unmeasured, here)) >= 2:
            continue
        return length, Step(batch, purpose)
    return None


def settle_lengths(core: Sequence[Trial], checks: Sequence[Trial], surface: Surface,
                   settings: SearchSettings) -> LengthSizing:
    """The bucket table at the chosen boundaries, the token budget and the trials that verify them."""
    usable, fraction = settings.usable_bytes, settings.limits.conservative_fraction
    buckets, read = bucket_table(surface, (), usable, fraction), _read(core, checks)
    verification, longest = {}, surface.at(max(surface.seq_lens))
    if longest is not None and longest.safe_peak_bytes is not None:
        verification["buckets"] = LengthCheck(longest.seq_len, longest.safe_batch_size,
                                              longest.safe_peak_bytes <= usable, longest.safe_peak_bytes)
    budget = _budget(surface, read, settings)
    for conservative, name in ((False, "budget"), (True, "conservative_budget")):
        if budget is None:
            break
        length, batch = budget.worst(conservative)
        here = [t for t in read if (t.seq_len, t.batch_size) == (length, batch) and t.ok]
        if here:
            trial = max(here, key=lambda t: t.peak_bytes)  # type: ignore[arg-type,return-value]
            verification[name] = LengthCheck(length, batch, trial.fits(usable), trial.peak_bytes)
    note = None if budget else (f"no token budget: one document of {max(surface.seq_lens)} tokens does not fit in "
                                f"usable memory")
    return LengthSizing(buckets, budget, verification, tuple(checks), note)
