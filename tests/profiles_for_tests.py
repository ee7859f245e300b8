"""Profiles built in memory for report tests: real Fit/Limits objects over synthetic trials.

``gpu_profile`` mimics an RTX 3060 running the seed documents' line (0.529 GB + 0.088 GB × batch),
with a trial over budget, one out of memory, and verification at the safe and conservative sizes.
``timed_profile`` gives a card its own speed: every trial times each step (a fixed cost per step plus one per
sample, with deterministic noise), its warm-up and its validation pass, and a steady trial of 40 steps runs at
the safe size, as a real calibration's do.
"""

from __future__ import annotations

import dataclasses

from vramcal.calibration.fit import fit_linear
from vramcal.calibration.limits import LimitSettings, compute_limits
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import Profile, Verification
from vramcal.records import Device, Trial

GIB = 2**30
SEED_OVERHEAD_BYTES = int(0.529e9)
SEED_SLOPE_BYTES = int(0.088e9)
# Deterministic "noise" in bytes, so fits have a non-zero residual and a visible band.
NOISE_BYTES = (3_000_000, -2_000_000, 4_000_000, -5_000_000, 1_000_000, -3_000_000, 2_000_000, 0, -1_000_000)


def gpu_trial(batch_size: int, peak_bytes: int, purpose: str = "grow") -> Trial:
    reserved = peak_bytes - 300 * 2**20
    step_s = 0.004 + 0.0009 * batch_size + 0.02 / (1 + batch_size)
    return Trial(batch_size=batch_size, status="ok", peak_bytes=peak_bytes, nvml_peak_bytes=peak_bytes - 2**20,
                 nvml_source="process", nvml_overhead_bytes=300 * 2**20, torch_max_reserved_bytes=reserved,
                 torch_max_allocated_bytes=reserved - 40 * 2**20, step_s=step_s,
                 samples_per_s=batch_size / step_s, purpose=purpose)


def host_trial(batch_size: int, peak_bytes: int, purpose: str = "grow", held_bytes: int | None = None) -> Trial:
    step_s = 0.05 + 0.01 * batch_size
    return Trial(batch_size=batch_size, status="ok", peak_bytes=peak_bytes, rss_peak_bytes=peak_bytes,
                 step_s=step_s, samples_per_s=batch_size / step_s, purpose=purpose, held_bytes=held_bytes)


def _like(model: Trial, batch_size: int, peak_bytes: int, purpose: str) -> Trial:
    """A trial measured like ``model`` (GPU sources or host RSS)."""
    make = gpu_trial if model.nvml_peak_bytes is not None else host_trial
    return make(batch_size, peak_bytes, purpose)


def gpu_device(name: str = "NVIDIA GeForce RTX 3060", total_bytes: int = 12288 * 2**20) -> Device:
    return Device(kind="cuda", name=name, total_bytes=total_bytes, total_source="NVML v2 total",
                  uuid="GPU-00000000-1111-2222-3333-444444444444", pci_bus_id="00000000:01:00.0", nvml_index=0,
                  driver_version="550.54.15", cuda_driver_version="12.4")


def seed_peak(batch_size: int, index: int = 0) -> int:
    return SEED_OVERHEAD_BYTES + SEED_SLOPE_BYTES * batch_size + NOISE_BYTES[index % len(NOISE_BYTES)]


def build_profile(device: Device, trials: list[Trial], spec: RegressorSpec | None = None,
                  implementation: str = "transformers", verify: bool = True,
                  verify_offset_bytes: int = -3_000_000) -> Profile:
    """Fit the ok trials within budget, compute limits, optionally add passing verification trials."""
    settings = LimitSettings()
    usable = settings.usable_bytes(device.total_bytes)
    fitted = [t for t in trials if t.fits(usable)]
    failed = [t.batch_size for t in trials if not t.fits(usable)]
    fit = limits = None
    verification = {}
    if len(fitted) >= 3:
        fit = fit_linear([t.batch_size for t in fitted], [t.peak_bytes for t in fitted])
        limits = compute_limits(fit, device.total_bytes, settings, min(failed) if failed else None)
        if verify:
            for kind, size in (("safe", limits.safe_batch_size), ("conservative", limits.conservative_batch_size)):
                # a real verification peak is not the fit's prediction: offset it, so a report that always
                # says "passed" or copies the prediction cannot pass the tests
                peak = int(fit.predict(size)) + verify_offset_bytes
                trial = _like(trials[0], size, peak, purpose=f"verify-{kind}")
                trials = [*trials, trial]
                verification[kind] = Verification(size, trial.fits(usable), trial.peak_bytes)
    spec = spec or RegressorSpec()
    return Profile(
        device=device, model=spec.ref(implementation), implementation=implementation,
        kernel_path="transformers Mamba2 torch_forward (pure PyTorch chunked scan)", settings=settings,
        trials=tuple(trials), fit=fit, limits=limits, verification=verification,
        data={"source": "synthetic", "data_bytes": 0, "on_device": False, "pool_bytes": 0},
        model_info={"n_params": spec.n_params()},
        software={"python": "3.11.9", "torch": "2.5.1", "transformers": "4.57.0"},
        run={"warmup_steps": 1, "measured_steps": 2}, created_utc="2025-01-02T03:04:05Z", vramcal_version="0.1.0")


def gpu_profile(verify: bool = True) -> Profile:
    """RTX 3060 12 GiB: batches 1..64 fit, 128 is over budget, 160 runs out of memory."""
    trials = [gpu_trial(b, seed_peak(b, i)) for i, b in enumerate((1, 2, 4, 8, 16, 32, 64, 128))]
    trials.append(Trial(batch_size=160, status="oom", purpose="grow", error="CUDA out of memory"))
    return build_profile(gpu_device(), trials, verify=verify)


def host_profile() -> Profile:
    device = Device(kind="host", name="AMD EPYC 7763 (2 cores)", total_bytes=8 * GIB, total_source="MemAvailable")
    trials = [host_trial(b, 600 * 2**20 + 9 * 2**20 * b + NOISE_BYTES[i] // 10)
              for i, b in enumerate((1, 2, 4, 8, 16))]
    return build_profile(device, trials, verify=True)


def sparse_profile() -> Profile:
    """Only two successful trials and a timeout: no fit, no limits, no verification."""
    trials = [gpu_trial(1, seed_peak(1)), gpu_trial(2, seed_peak(2, 1)),
              Trial(batch_size=4, status="timeout", purpose="grow", error="killed after the 900 s time limit")]
    return build_profile(gpu_device(), trials)


STEP_NOISE = (0.01, -0.02, 0.015, -0.005, 0.02, -0.01, 0.0, 0.005, -0.015, 0.01)  # relative, per step


def step_seconds(batch_size: int, fixed_s: float, per_sample_s: float, index: int = 0) -> float:
    """The synthetic card's step time: ``fixed_s + per_sample_s × batch_size``, times (1 + a little noise)."""
    return (fixed_s + per_sample_s * batch_size) * (1 + STEP_NOISE[index % len(STEP_NOISE)])


def timed(trial: Trial, fixed_s: float, per_sample_s: float, steps: int = 2) -> Trial:
    """``trial`` with ``steps`` timed steps, a warm-up step 1.5 × as long and a validation pass a third of a step."""
    times = tuple(step_seconds(trial.batch_size, fixed_s, per_sample_s, i + trial.batch_size) for i in range(steps))
    median = sorted(times)[len(times) // 2]
    return dataclasses.replace(trial, step_times_s=times, step_s=median, samples_per_s=trial.batch_size / median,
                               warmup_times_s=(1.5 * times[0],), val_times_s=(times[0] / 3,))


def timed_profile(name: str = "NVIDIA GeForce RTX 4090", total_bytes: int = 24564 * 2**20, fixed_s: float = 0.01,
                  per_sample_s: float = 0.0004, sizes: tuple[int, ...] = (1, 8, 32, 64, 128, 192),
                  steps: int = 2) -> Profile:
    """A verified GPU profile of one card whose steps take ``fixed_s + per_sample_s × batch`` seconds; every trial
    timed (``steps`` steps: two give 95 % intervals of about ±15 %, ten of about ±1 %), a steady trial of 40 steps
    at the safe size, and the regressor's windows of the E-mini sample in its ``model_info`` (424 training, 105
    validation)."""
    trials = [gpu_trial(b, seed_peak(b, i)) for i, b in enumerate(sizes)]
    profile = build_profile(gpu_device(name, total_bytes), trials)
    steady = dataclasses.replace(profile.trials[-2], purpose="steady")  # the safe size's verification trial
    trials = [timed(t, fixed_s, per_sample_s, steps) for t in profile.trials] + [timed(steady, fixed_s, per_sample_s,
                                                                                        40)]
    return dataclasses.replace(profile, trials=tuple(trials),
                               model_info={**profile.model_info, "train_windows": 424, "val_windows": 105,
                                           "data": "es_1s.parquet"})
