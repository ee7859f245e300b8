"""Sizing: from a profile to the batch size a run uses and what the profile predicts for it, decided once
(DESIGN.md, "Training with a profile", "Framework processes", "The gate"). Every caller sizes through :func:`size`.

A run holding ``delta`` bytes beyond its trials (the data term: data in the measured memory; the process term: what
a framework's process holds as training starts, which replaces it; the gradient term: gradients alive through the
forward pass; the gate: memory other processes took since, for the limits only) is predicted and limited as

    predicted(b) = max(overhead + slope × b, verified peak at b) + delta
    upper(b) = max(fit.upper(b), verified peak at b) + delta
    safe = min(profile safe, max(largest b with verified_peak − (predicted(safe) − predicted(b)) + delta ≤ usable,
                                 largest b with upper(b) ≤ usable))          conservative = ⌊fraction × safe⌋
    warning line = max(upper(b), predicted(b) × (1 + spread)) [+ the process term's own spread]

``spread``: the widest of repeated trials, the runs the profile recorded and :data:`BENCH_SPREAD`
(:func:`repeat_spread`). Modules: :mod:`~vramcal.sizing.request` (the request and its answer),
:mod:`~vramcal.sizing.terms`, :mod:`~vramcal.sizing.rule` (:func:`size`), :mod:`~vramcal.sizing.throughput`,
:mod:`~vramcal.sizing.reading` (``vramcal limits`` and a run's peak against its sizing).
"""

from vramcal.sizing.reading import Answer, answer, compare, verdict
from vramcal.sizing.request import (
    LIMITS,
    GradientsHeld,
    Limit,
    NoLimitsError,
    SizeFor,
    SizeRequest,
    Sizing,
    SizingError,
    check_counts,
)
from vramcal.sizing.rule import accumulation, basis_notice, fitted_from, length_model, run_failure_cap, scaled_lr, size
from vramcal.sizing.terms import (
    BENCH_SPREAD,
    PROCESS_REPEAT_BYTES,
    extra_bytes,
    length_trials,
    process_spread,
    repeat_spread,
)
from vramcal.sizing.throughput import THROUGHPUT, throughput_choice

__all__ = [  # the names importers take from the wing's face
    "BENCH_SPREAD", "LIMITS", "PROCESS_REPEAT_BYTES", "THROUGHPUT", "Answer", "GradientsHeld", "Limit",
    "NoLimitsError", "SizeFor", "SizeRequest", "Sizing", "SizingError", "accumulation", "answer", "basis_notice",
    "check_counts", "compare", "extra_bytes", "fitted_from", "length_model", "length_trials", "process_spread",
    "repeat_spread", "run_failure_cap", "scaled_lr", "size", "throughput_choice", "verdict",
]
