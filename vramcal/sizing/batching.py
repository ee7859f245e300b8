"""Batches of lengths that vary, sized by a profile: its bucket table and token budget (the arithmetic:
:mod:`vramcal.calibration.lengths`), as its calibration recorded them or computed from its surface, each with its
worst case and the recorded trial that verified it (:attr:`Worst.check` None: ``vramcal limits --verify`` runs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vramcal.calibration.lengths import Bucket, LengthCheck, TokenBudget, bucket_table, token_budget
from vramcal.profile import Profile
from vramcal.sizing import SizingError


@dataclass(frozen=True)
class Worst:
    """A worst case to verify: ``batch_size`` samples of ``seq_len`` tokens (padded to a multiple of chunk_size).

    Attributes:
        what: for people (``the longest bucket``, ``the token budget``, ``the conservative token budget``).
        check: the real trial that verified exactly this batch, recorded in the profile; None: none did.
    """

    what: str
    seq_len: int
    batch_size: int
    check: LengthCheck | None


def _surface(profile: Profile):
    """Raises: SizingError: a profile of one length (no surface), one line with the fix."""
    if profile.surface is None:
        raise SizingError("the profile was calibrated at one seq_len: buckets and a token budget need several "
                          "(vramcal probe --seq-len SHORTEST:LONGEST)")
    return profile.surface


def buckets(profile: Profile, boundaries: Sequence[int] = ()) -> tuple[tuple[Bucket, ...], Worst]:
    """The bucket table at ``boundaries`` (each bucket's longest length; () the calibration's choice) and its worst
    case, the longest bucket at its safe batch.

    Raises:
        SizingError: a profile of one length; a boundary below 1 or above the profile's longest seq_len.
    """
    surface = _surface(profile)
    usable = profile.settings.usable_bytes(profile.device.total_bytes)
    if not boundaries and profile.lengths is not None:
        table = profile.lengths.buckets
    else:
        try:
            table = bucket_table(surface, boundaries, usable, profile.settings.conservative_fraction)
        except ValueError as error:
            raise SizingError(str(error)) from None
    last = table[-1]
    entry = surface.at(last.padded_seq_len)
    check = None
    if entry is not None and entry.safe_batch_size == last.safe_batch_size and entry.safe_peak_bytes is not None:
        check = LengthCheck(entry.seq_len, entry.safe_batch_size, entry.safe_peak_bytes <= usable,
                            entry.safe_peak_bytes)
    return table, Worst("the longest bucket", last.padded_seq_len, last.safe_batch_size, check)


def budget(profile: Profile) -> tuple[TokenBudget, tuple[Worst, Worst]]:
    """The token budget over the profile's calibrated range, and its two worst cases (the safe budget's and the
    conservative one's), each with the recorded trial that verified it.

    Raises:
        SizingError: a profile of one length; one document of the longest length does not fit.
    """
    surface = _surface(profile)
    recorded = profile.lengths
    if recorded is not None and recorded.budget is not None:
        found, checks = recorded.budget, recorded.verification
    else:
        try:
            found = token_budget(surface, profile.settings.usable_bytes(profile.device.total_bytes),
                                 profile.settings.conservative_fraction)
        except ValueError as error:
            raise SizingError(str(error)) from None
        checks = {}
    worst = []
    for conservative, name, what in ((False, "budget", "the token budget"),
                                     (True, "conservative_budget", "the conservative token budget")):
        length, batch = found.worst(conservative)
        check = checks.get(name)
        matches = check is not None and (check.seq_len, check.batch_size) == (length, batch)
        shortest = found.conservative_worst_seq_len if conservative else found.worst_seq_len
        worst.append(Worst(f"{what} (its worst length: documents of {shortest} tokens)", length, batch,
                           check if matches else None))
    return found, (worst[0], worst[1])
