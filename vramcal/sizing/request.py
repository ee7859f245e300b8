"""What a run asks of a profile (:class:`SizeRequest`) and what sizing answers (:class:`Sizing`), with the checks
every door of the sizing wing shares; the rules are :mod:`vramcal.sizing`'s."""

from __future__ import annotations

import dataclasses
import enum
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from vramcal.profile import Profile
from vramcal.words import given, word

Limit = Literal["conservative", "safe"]  # which of the profile's limits a run takes
LIMITS: tuple[str, ...] = ("conservative", "safe")
SizeFor = Literal["memory", "throughput"]  # what a run without a requested batch size is sized for
SIZE_FOR: tuple[str, ...] = ("memory", "throughput")
# where a batch size comes from: a limit, the throughput knee, the request within the bounds, or moved into them
Source = Literal["conservative", "safe", "knee", "requested", "clamped"]


class SizingError(ValueError):
    """No usable profile or batch size; the one-line message says which command or option fixes it."""


class NoLimitsError(SizingError):
    """A profile without usable limits: calibrating again at the same budget gives the same (README "Exit codes": 3)."""

    NO_LIMITS = "the profile has no usable limits (nothing fitted or nothing fits)"


def check_counts(**counts: object) -> None:
    """Each of ``counts`` None or a whole number (``*_bytes`` >= 0, the others >= 1), named in the caller's words
    (:func:`vramcal.words.word`).

    Raises:
        TypeError: a count that is no whole number (a float, a bool, a string). SizingError: one out of range.
    """
    for name, value in counts.items():
        if value is None:
            continue
        in_bytes = name.endswith("_bytes")
        setting = "batch_size" if name == "request" else name
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            spoken = f"{name}=" if in_bytes else word(setting)
            raise TypeError(f"{spoken} takes a whole number, not {type(value).__name__} {value!r:.40}")
        low = 0 if in_bytes else 1
        if value < low:
            shown = f"{name}={value}" if in_bytes else given(setting, value)
            raise SizingError(f"{shown} is below {low}: give a whole number >= {low}")


def check_profile(profile: object) -> None:
    """Raise TypeError unless ``profile`` is a :class:`~vramcal.profile.Profile`."""
    if not isinstance(profile, Profile):
        raise TypeError(f"profile= takes a vramcal.Profile, not {type(profile).__name__} {profile!r:.40}: read a file "
                        f"with vramcal.load_profile(path)")


class GradientsHeld(enum.Enum):
    """Why a run's forward passes run beside the previous step's gradients (the gradient term): ``ACCUMULATION``
    (micro-batches after the first), ``AUTOMATIC_OPTIMIZATION`` (Lightning zeroes them after the next forward
    pass), ``LOOP`` (a loop of the caller's own that does the same)."""

    ACCUMULATION = "accumulation"
    AUTOMATIC_OPTIMIZATION = "automatic_optimization"
    LOOP = "loop"

    def says(self, accumulation_steps: int = 1) -> str:
        """The reason, for people (the gradient term's notice)."""
        if self is GradientsHeld.ACCUMULATION:
            return (f"accumulation: the micro-batches after the first of each of its {accumulation_steps} run beside "
                    f"the gradients accumulated so far")
        if self is GradientsHeld.AUTOMATIC_OPTIMIZATION:
            return "Lightning's automatic optimization zeroes them after the next forward pass"
        return "this loop zeroes them after the next forward pass"


@dataclass(frozen=True)
class SizeRequest:
    """What a run asks of a profile: the record :func:`vramcal.sizing.size` takes, checked when made.

    Attributes:
        limit: the profile's limit a run takes when nothing is requested (:data:`LIMITS`).
        batch_size_min: the smallest batch size acceptable (samples, >= 1).
        request: the caller's batch size (samples, >= 1), clamped to ``[batch_size_min, safe]``; None: ``limit``.
        effective_batch_size: samples per optimizer step to keep (>= 1): the batch size found is then the
            micro-batch. ``exact``: a micro-batch that divides it.
        size_for: ``memory`` takes ``limit``; ``throughput`` the throughput knee below it
            (:func:`vramcal.sizing.throughput_choice`).
        seq_len: the run's sequence length (tokens, >= 1), for a profile calibrated over several.
        gradients: why the forward passes run beside the gradients (None: they do not; accumulation adds it).

    Raises:
        TypeError: a count that is no whole number, ``gradients`` no :class:`GradientsHeld`. SizingError: a limit,
            a count or ``size_for`` out of range.
    """

    limit: Limit = "conservative"
    batch_size_min: int = 1
    request: int | None = None
    effective_batch_size: int | None = None
    exact: bool = False
    size_for: SizeFor = "memory"
    seq_len: int | None = None
    gradients: GradientsHeld | None = None

    def __post_init__(self) -> None:
        if self.limit not in LIMITS:
            raise SizingError(f"limit={self.limit!r} is not a limit: use one of {', '.join(map(repr, LIMITS))}")
        if self.size_for not in SIZE_FOR:
            raise SizingError(f"size_for={self.size_for!r} is not a choice: use one of "
                              f"{', '.join(map(repr, SIZE_FOR))}")
        check_counts(batch_size_min=self.batch_size_min, request=self.request, seq_len=self.seq_len,
                     effective_batch_size=self.effective_batch_size)
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact= takes True or False, not {type(self.exact).__name__} {self.exact!r:.40}")
        if self.gradients is not None and not isinstance(self.gradients, GradientsHeld):
            raise TypeError(f"gradients= takes a vramcal.sizing.GradientsHeld or None, not "
                            f"{type(self.gradients).__name__} {self.gradients!r:.40}")

    def replace(self, **changes: Any) -> SizeRequest:
        """This request with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Sizing:
    """The batch size a run uses, why, and what the profile predicts for it. Bytes are integers.

    Attributes:
        batch_size: samples per micro-batch (per optimizer step when ``accumulation_steps`` is 1).
        source: where the batch size comes from (:data:`Source`).
        capped_by_data: lowered to the training samples there are (the trainer). :attr:`label` says both.
        missing_bytes: what the device was missing against the profile's budget (the gate): lowers the limits only.
        safe_batch_size, conservative_batch_size: the limits in force (after the terms).
        predicted_peak_bytes, upper_bytes: point prediction and upper 95 % bound of the run's peak.
        warn_bytes, warn_basis: the warning line (0 in records made before it: :attr:`line_bytes`) and what
            widened it, for people.
        usable_bytes, total_bytes: the profile's memory figures.
        data_delta_bytes, process_delta_bytes, gradient_delta_bytes: the data, process and gradient terms.
        verified: the profile's limits were verified by real trials.
        notices: one line each, for people; information marked :class:`~vramcal.words.Info`, the rest warnings.
        fitted_from: the smallest fitted batch size (None: a 2-D model); below it the prediction extrapolates.
        accumulation_steps: micro-batches per optimizer step.
        effective_batch_size: samples per optimizer step (the last micro-batch may be smaller).
    """

    batch_size: int
    source: Source
    safe_batch_size: int
    conservative_batch_size: int
    predicted_peak_bytes: int
    upper_bytes: int
    usable_bytes: int
    total_bytes: int
    data_delta_bytes: int
    verified: bool
    notices: tuple[str, ...] = ()
    fitted_from: int | None = None
    process_delta_bytes: int = 0
    accumulation_steps: int = 1
    effective_batch_size: int | None = None
    gradient_delta_bytes: int = 0
    capped_by_data: bool = False
    missing_bytes: int = 0
    warn_bytes: int = 0
    warn_basis: str = ""

    @property
    def line_bytes(self) -> int:
        """The warning line (bytes): ``warn_bytes``, or the upper bound in a record made before it."""
        return self.warn_bytes or self.upper_bytes

    @property
    def label(self) -> str:
        """``source`` with ``+accumulated`` and ``+data`` marks (``conservative+accumulated``)."""
        return self.source + "+accumulated" * (self.accumulation_steps > 1) + "+data" * self.capped_by_data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sizing:
        """The sizing a run record holds (``dataclasses.asdict``; older records hold ``conservative+data``)."""
        source, *marks = data["source"].split("+")
        return cls(**{**data, "source": source, "notices": tuple(data["notices"]),
                      "capped_by_data": data.get("capped_by_data", "data" in marks)})
