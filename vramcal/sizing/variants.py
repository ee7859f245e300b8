"""Variants of one model and the choice among them by measured speed (DESIGN.md, "Variants: memory for speed").

A variant (activation checkpointing, the SSD ``chunk_size``) changes how a step holds memory and how fast it runs,
never what it computes (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; Dao and Gu 2024,
"Transformers are SSMs", section 6), so a model's variant profiles are alternatives for one run, each verified on
its own. :func:`variants_of` finds them, :func:`variant_rows` tabulates them, :func:`choose` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vramcal.calibration.throughput import (
    NO_DIFFERENCE,
    Rate,
    find_knee,
    measured_rates,
    overlap,
    rate_for_run,
    rate_text,
)
from vramcal.profile import Profile, profiles_where
from vramcal.records import Device, World
from vramcal.sizing import SizeRequest, Sizing, SizingError, length_trials, size
from vramcal.workload import ModelRef

VARIANT_FIELDS = ("checkpointing", "chunk_size")  # the model's settings that make a variant
GIB = 2**30


def same_model(a: ModelRef, b: ModelRef) -> bool:
    """Whether two model keys differ at most in their variant settings (checkpointing absent is ``off``)."""
    return a.factory == b.factory and a.without(*VARIANT_FIELDS) == b.without(*VARIANT_FIELDS)


def variant_label(ref: ModelRef) -> str:
    """``checkpointing block, chunk_size 64``: a model's variant settings, for people (a family whose chunk size is
    inside its config, the ``lm``'s, shows checkpointing alone)."""
    chunk = ref.params.get("chunk_size")
    return f"checkpointing {ref.params.get('checkpointing', 'off')}" + (f", chunk_size {chunk}" if chunk else "")


def variants_of(model: ModelRef, device: Device, profiles_dir: Path | str, *, world: World | None = None,
                total_bytes: int | None = None) -> list[tuple[Path, Profile]]:
    """The newest readable profile of each variant of ``model`` under ``profiles_dir`` on ``device``'s hardware, in
    ``world`` and (when given) at ``total_bytes``, in the order of their paths."""
    found, _ = profiles_where(profiles_dir, device, lambda p: same_model(p.model, model) and p.world == world,
                              total_bytes)
    newest: dict[str, Profile] = {}
    for profile in found:  # oldest first: a later one of a variant replaces it only when it was made later
        key = profile.model.key()
        if key not in newest or profile.created_utc > newest[key].created_utc:
            newest[key] = profile
    return sorted(((p.path, p) for p in newest.values()), key=lambda row: str(row[0]))


@dataclass(frozen=True)
class VariantRow:
    """One variant's figures: the measured samples/s at the conservative batch size, the throughput knee and its
    rate (None: none), and ``rate_conservative`` per GiB of the predicted peak there."""

    path: Path
    profile: Profile
    label: str
    rate_conservative: Rate | None
    knee_batch_size: int | None
    knee_rate: Rate | None
    samples_per_s_per_gib: float | None

    def to_dict(self) -> dict:
        limits, fit = self.profile.limits, self.profile.fit
        return {"path": str(self.path), "variant": self.label, "model": self.profile.model.to_dict(),
                "verified": self.profile.verified, "safe_batch_size": limits and limits.safe_batch_size,
                "conservative_batch_size": limits and limits.conservative_batch_size,
                "slope_bytes_per_sample": fit and fit.slope_bytes_per_sample,
                "samples_per_s_conservative": self.rate_conservative and self.rate_conservative.samples_per_s,
                "knee_batch_size": self.knee_batch_size,
                "samples_per_s_knee": self.knee_rate and self.knee_rate.samples_per_s,
                "samples_per_s_per_gib": self.samples_per_s_per_gib}


def variant_rows(found: Sequence[tuple[Path, Profile]], seq_len: int | None = None) -> list[VariantRow]:
    """Each variant's row (:class:`VariantRow`), at ``seq_len`` for a profile over several lengths."""
    rows = []
    for path, profile in found:
        rates = measured_rates(length_trials(profile, seq_len))
        limits = profile.limits
        rate = knee = per_gib = None
        if limits is not None:
            rate = rate_for_run(rates, limits.conservative_batch_size)
            knee = find_knee(rates, 1, limits.safe_batch_size)
            if rate is not None and profile.fit is not None:
                per_gib = rate.samples_per_s / (profile.fit.predict(limits.conservative_batch_size) / GIB)
        usable = knee is not None and not knee.refused
        rows.append(VariantRow(path, profile, variant_label(profile.model), rate, usable and knee.batch_size or None,
                               usable and knee.rate or None, per_gib))
    return rows


@dataclass(frozen=True)
class Candidate:
    """A variant sized for a run: its profile, the sizing (batch, accumulation) and the rate there."""

    path: Path
    profile: Profile
    sizing: Sizing
    rate: Rate | None


@dataclass(frozen=True)
class Choice:
    """The variant a run trains with (:func:`choose`), the candidates fastest first, a line for each variant passed
    over, and why the chosen one."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    passed_over: tuple[str, ...]
    reason: str


def choose(found: Sequence[tuple[Path, Profile]], ask: SizeRequest, named: ModelRef) -> Choice:
    """The variant, batch and accumulation with the highest measured samples/s for ``ask`` among the verified
    variants in ``found`` that admit it; ``named`` (the run's) is kept unless another's 95 % interval lies apart
    above it. A checkpointed variant that trains what an uncheckpointed one of its chunk_size trains is passed
    over first (bench/README.md, "Checkpointing or accumulation").

    Raises:
        SizingError: no verified variant admits the request (one line: each variant and why).
    """
    candidates, passed_over = [], []
    for path, profile in found:
        label = variant_label(profile.model)
        if not profile.verified:
            passed_over.append(f"{label}: its limits are not verified")
            continue
        try:
            sizing = size(profile, ask)
        except SizingError as error:
            passed_over.append(f"{label}: {error}")
            continue
        if sizing.source == "clamped" and ask.request is not None and sizing.batch_size < ask.request:
            passed_over.append(f"{label}: batch_size {ask.request} is above its safe batch size "
                               f"{sizing.safe_batch_size}")
            continue
        rate = rate_for_run(measured_rates(length_trials(profile, ask.seq_len)), sizing.batch_size)
        candidates.append(Candidate(path, profile, sizing, rate))
    candidates, recomputing = _without_recomputing_alike(candidates)
    passed_over += recomputing
    if not candidates:
        raise SizingError("no calibrated variant can train this run: " + ("; ".join(passed_over) or
                                                                          "none was found"))
    candidates.sort(key=lambda c: -(c.rate.samples_per_s if c.rate else 0.0))
    fastest = candidates[0]
    own = next((c for c in candidates if c.profile.model == named), None)
    if own is None or own is fastest:
        why = "the variant named" if own is fastest else "the fastest measured"
        return Choice(fastest, tuple(candidates), tuple(passed_over), f"{why}: {_said(fastest)}")
    if fastest.rate is None or own.rate is None or overlap(fastest.rate.interval, own.rate.interval):
        return Choice(own, tuple(candidates), tuple(passed_over),
                      f"the variant named: {_said(own)}; {NO_DIFFERENCE} from the fastest measured, {_said(fastest)}")
    gain = fastest.rate.samples_per_s / own.rate.samples_per_s - 1
    return Choice(fastest, tuple(candidates), tuple(passed_over),
                  f"{_said(fastest)}: {gain:.0%} more samples/s than the variant named, {_said(own)}")


def _without_recomputing_alike(candidates: list[Candidate]) -> tuple[list[Candidate], list[str]]:
    """The candidates less the checkpointed ones that an uncheckpointed one trains alike, and a line for each."""
    def plain(c: Candidate) -> bool:
        return c.profile.model.params.get("checkpointing", "off") == "off"

    def shape(c: Candidate) -> tuple:
        return c.profile.model.params.get("chunk_size"), c.sizing.batch_size, c.sizing.accumulation_steps

    trained_plainly = {shape(c): c for c in candidates if plain(c)}
    kept, lines = [], []
    for c in candidates:
        alike = None if plain(c) else trained_plainly.get(shape(c))
        if alike is None:
            kept.append(c)
        else:
            lines.append(f"{variant_label(c.profile.model)}: trains {_batch(c.sizing)} as "
                         f"{variant_label(alike.profile.model)} does, recomputing its blocks")
    return kept, lines


def _batch(s: Sizing) -> str:
    return f"batch_size {s.batch_size}" + (f" x {s.accumulation_steps} accumulated" if s.accumulation_steps > 1 else "")


def _said(candidate: Candidate) -> str:
    rate = f" at {rate_text(candidate.rate)} samples/s" if candidate.rate else " (no measured rate there)"
    return f"{variant_label(candidate.profile.model)}, {_batch(candidate.sizing)}{rate}"
