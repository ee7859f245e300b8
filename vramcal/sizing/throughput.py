"""Sizing for throughput (``size_for="throughput"``): the throughput knee when it lies below the limit and its rate
differs measurably from the limit's (their 95 % intervals apart), the limit otherwise."""

from __future__ import annotations

from vramcal.calibration.throughput import NO_DIFFERENCE, find_knee, measured_rates, overlap, rate_at, rate_text
from vramcal.profile import Profile
from vramcal.sizing.terms import length_trials
from vramcal.units import format_rate

THROUGHPUT = "sizing for throughput"  # how throughput_choice's reason begins (the forecast's notes carry it)


def throughput_choice(profile: Profile, seq_len: int | None, limit_batch: int, limit_name: str,
                      batch_size_min: int = 1, safe: int | None = None) -> tuple[int, str, str]:
    """(batch size, source, why): the knee (:func:`vramcal.calibration.throughput.find_knee` over
    ``[batch_size_min, safe]``, ``safe`` default the profile's) when below ``limit_batch`` and its interval apart
    from the rate there (:func:`vramcal.calibration.throughput.overlap`), else the limit (``limit_name``)."""
    rates = measured_rates(length_trials(profile, seq_len))
    high = safe if safe is not None else profile.limits.safe_batch_size if profile.limits else limit_batch
    knee = find_knee(rates, batch_size_min, max(high, limit_batch))
    at_limit = rate_at(rates, limit_batch)
    there = f" at {rate_text(at_limit)} samples/s" if at_limit else ""
    keep = f"using the {limit_name} batch size {limit_batch}"
    if knee is None:
        return limit_batch, limit_name, (f"{THROUGHPUT}: no measured throughput up to batch_size "
                                         f"{limit_batch}: {keep}")
    if knee.refused:
        return limit_batch, limit_name, f"{THROUGHPUT}: no throughput knee: {knee.refused}; {keep}"
    reach = (f"the throughput knee, the smallest measured batch size reaching {knee.fraction * 100:g} % of the best "
             f"{format_rate(knee.best.samples_per_s)} samples/s (at batch_size {knee.best.batch_size})")
    if knee.batch_size >= limit_batch:
        return limit_batch, limit_name, (f"{THROUGHPUT}: {reach}, batch_size {knee.batch_size}, is not "
                                         f"below the {limit_name} batch size {limit_batch}: using {limit_batch}")
    if at_limit is None or overlap(knee.rate.interval, at_limit.interval):
        return limit_batch, limit_name, (f"{THROUGHPUT}: {NO_DIFFERENCE} in samples/s between batch_size "
                                         f"{knee.batch_size} at {rate_text(knee.rate)}, {reach}, and the "
                                         f"{limit_name} batch size {limit_batch}{there or ' (no rate there)'}: their "
                                         f"95 % intervals overlap; {keep}")
    gain = knee.best.samples_per_s / knee.rate.samples_per_s - 1
    beyond = (f"no measured size gains more than {gain:.1%} over it" if knee.best is not knee.rate
              else "no measured size is faster")
    if not knee.rate.steady:
        beyond += (f" (its rate rests on {knee.rate.n_steps} timed step{'s' * (knee.rate.n_steps != 1)} of short "
                   f"trials: the first epoch's time against the forecast will tell)")
    return knee.batch_size, "knee", (f"{THROUGHPUT}: batch_size {knee.batch_size} at "
                                     f"{rate_text(knee.rate)} samples/s is {reach}, below the {limit_name} batch "
                                     f"size {limit_batch}{there}; {beyond}")
