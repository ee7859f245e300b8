"""The benchmark's pure parts on synthetic results: rounds and their medians and spreads, targets, the answers
that need survival runs, the truth's bisection and cache, the closed-loop sizing, the data term's GPU path,
and the Python-versions comparison; one real two-step survival run on the tiny spec. No Lightning, no
Accelerate."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_train import SPEC, training_folder

from bench.compare import parse_args, round_orders, survival_runs
from bench.data_term import gpu_path, tile_bars
from bench.python_versions import Calibration, agreement
from bench.survive import outcome, sizing_at
from bench.table import ResultsError, markdown, needs_survival, ratios, rows, summary, survival_sizes, targets
from bench.truth import bisect_largest, cached
from vramcal.calibration.fit import fit_linear
from vramcal.models.regressor.bars import synthetic_bars
from vramcal.models.regressor.windows import make_windows
from vramcal.sizing import SizeRequest, size

from profiles_for_tests import host_profile

MIB = 2**20
SAFE_PEAK = ("vramcal: trainer's peak at the safe size within ±3 % of the prediction, at or below the upper bound "
             "and within usable memory")
CONSERVATIVE_PEAK = SAFE_PEAK.replace("safe", "conservative")
BOUNDARY = "vramcal: predicted boundary within 1 % of the ground truth (or between it and the first failing size)"
WALL = "vramcal: median wall time at most 0.33× Lightning binsearch's"
OK_TRIAL = {"batch_size": 1, "status": "ok"}


def _vramcal_run(round_number: int, wall_s: float, conservative: int, safe: int, boundary: float,
                 tool: str = "vramcal") -> dict:
    return {"round": round_number, "position": 0, "answer": conservative, "trials": [OK_TRIAL] * 6,
            "process_wall_s": wall_s, "returncode": 0, "profile_label": f"{tool}/r{round_number}",
            "limits": {"conservative_batch_size": conservative, "safe_batch_size": safe,
                       "boundary_batch_size": boundary, "usable_bytes": 2**29}}


def _anchor_run(round_number: int, wall_s: float, answer: int | None, trials: int = 12) -> dict:
    return {"round": round_number, "position": 1, "answer": answer, "trials": [OK_TRIAL] * trials,
            "process_wall_s": wall_s, "returncode": 0 if answer else 1}


def _survival(batch_size: int, status: str, peak_mib: float, predicted_mib: float, upper_mib: float,
              steps_done: int = 200, usable_mib: float = 1100) -> dict:
    prediction = {"predicted_peak_bytes": int(predicted_mib * MIB), "upper_bytes": int(upper_mib * MIB),
                  "usable_bytes": int(usable_mib * MIB)}
    return {"batch_size": batch_size, "status": status, "steps": 200, "steps_done": steps_done,
            "peak_bytes": int(peak_mib * MIB), **prediction, "sources": ["x"], "profile_label": "vramcal/r1",
            "wall_s": 100.0, "predictions": {f"vramcal/r{r}": prediction for r in (1, 2, 3)}}


def _results() -> dict:
    return {
        "bench_schema": 2, "spec_name": "small", "spec": {"d_model": 64}, "steps": 200, "rounds": 3, "seed": 0,
        "accelerate_start": 1024, "quick": False, "data": {"path": "data/es_1s.parquet", "stride": 1},
        "orders": [["vramcal", "lightning-binsearch"]] * 3,
        "environment": {"budget": "1.50 GiB", "budget_bytes": 1610612736, "machine": "cpu", "cpus": 2,
                        "platform": "linux", "versions": {"torch": "2.13.0"}, "limit": "RLIMIT_DATA",
                        "created_utc": "2025-01-01T00:00:00Z", "load_average_start": [1.0, 1.0, 1.0]},
        "limit_check": {"binds": True, "recognised_by_all": True},
        "ground_truth": {"batch_size": 200, "first_failing_batch_size": 201, "trials": [{"batch_size": 1,
                                                                                         "status": "ok"}] * 10,
                         "wall_s": 90.0, "key": {"vramcal_commit": "abc1234"}},
        "runs": {
            "vramcal": [_vramcal_run(1, 20.0, 120, 134, 200.5), _vramcal_run(2, 30.0, 120, 134, 201.0),
                        _vramcal_run(3, 25.0, 121, 135, 201.5)],
            "lightning-binsearch": [_anchor_run(1, 120.0, 190), _anchor_run(2, 80.0, 190), _anchor_run(3, 100.0, 190)],
            "accelerate": [_anchor_run(1, 60.0, 190, 3), _anchor_run(2, 70.0, None, 3), _anchor_run(3, 65.0, 190, 3)],
        },
        "survival": [_survival(190, "oom-fallback", 1500, 1400, 1450, steps_done=40),
                     _survival(135, "ok", 1000, 980, 1030), _survival(134, "ok", 1000, 990, 1040),
                     _survival(121, "ok", 930, 920, 960), _survival(120, "ok", 925, 915, 955)],
    }


def test_a_tool_summary_gives_the_median_and_range_of_its_rounds_and_whether_answers_differ():
    figures = summary(_results()["runs"]["lightning-binsearch"])
    assert (figures["wall_s_median"], figures["wall_s_min"], figures["wall_s_max"]) == (100.0, 80.0, 120.0)
    assert figures["answers"] == [190, 190, 190] and not figures["answers_differ"]
    accelerate = summary(_results()["runs"]["accelerate"])
    assert accelerate["answers_differ"] and accelerate["failed_rounds"] == [2]


def test_rows_show_medians_spreads_differing_answers_and_survival():
    by_tool = {row["tool"]: row for row in rows(_results())}
    conservative = by_tool["vramcal conservative"]
    assert conservative["wall_s_median"] == "25.0" and conservative["wall_s_range"] == "20.0-30.0"
    assert conservative["batch_size"] == "120 / 120 / 121 (differ)"
    assert conservative["error_pct"] == "-40.0"  # median 120 against 200
    assert conservative["survived"] == "yes"  # 120 and 121 both finished
    assert by_tool["vramcal predicted boundary"]["batch_size"] == "200.5 / 201.0 / 201.5 (differ)"
    assert by_tool["vramcal predicted boundary"]["error_pct"] == "+0.5"
    assert by_tool["lightning-binsearch"]["batch_size"] == "190"
    assert by_tool["lightning-binsearch"]["survived"] == "no (oom-fallback at step 40)"
    assert by_tool["accelerate (failed in round 2)"]["batch_size"] == "190 / - / 190 (differ)"


def test_ratios_divide_medians():
    assert ratios(_results()) == [
        {"tool": "vramcal", "anchor": "lightning-binsearch", "wall_ratio": "0.25", "trials_ratio": "0.50"},
        {"tool": "vramcal", "anchor": "accelerate", "wall_ratio": "0.38", "trials_ratio": "2.00"}]


def test_targets_hold_in_every_round_or_not_at_all():
    by_target = {t["target"]: t for t in targets(_results())}
    boundary = by_target[BOUNDARY]
    assert boundary["met"] == "yes" and "201.5 (+0.8 %)" in boundary["measured"]
    assert by_target["vramcal: safe batch size never above the ground truth"]["met"] == "yes"
    assert by_target["vramcal: median wall time at most 0.33× Lightning binsearch's"]["met"] == "yes"
    assert by_target["vramcal: 200 training steps at the safe size finish with no out-of-memory error"]["met"] == "yes"
    safe = by_target[SAFE_PEAK]
    assert safe["met"] == "yes" and "b=135" in safe["measured"] and "usable 1.07 GiB" in safe["measured"]

    results = _results()
    results["runs"]["vramcal"][2]["limits"]["boundary_batch_size"] = 203.0  # +1.5 % in one round of three
    results["survival"][3] = _survival(121, "ok", 950, 920, 960)  # +3.3 %, though below the upper bound
    results["survival"][1] = _survival(135, "ok", 1000, 980, 1030, usable_mib=990)  # +2.0 %, above usable memory
    by_target = {t["target"]: t for t in targets(results)}
    assert by_target[BOUNDARY]["met"] == "**no**"
    conservative = by_target[CONSERVATIVE_PEAK]
    assert conservative["met"] == "**no**" and "+3.3 %" in conservative["measured"]
    assert by_target[SAFE_PEAK]["met"] == "**no**"

    results = _results()  # a truth of 57 (58 fails): one sample is 1.75 %, and an edge between the two is as close
    results["ground_truth"].update(batch_size=57, first_failing_batch_size=58)  # as the bisection can tell
    for run, boundary in zip(results["runs"]["vramcal"], (57.9, 57.0, 57.3)):
        run["limits"]["boundary_batch_size"] = boundary
    boundary = {t["target"]: t for t in targets(results)}[BOUNDARY]
    assert boundary["met"] == "yes" and "57.9 (+1.6 %, inside)" in boundary["measured"], boundary
    results["runs"]["vramcal"][1]["limits"]["boundary_batch_size"] = 58.1  # +1.9 %, past the first failing size
    assert {t["target"]: t for t in targets(results)}[BOUNDARY]["met"] == "**no**"

    results = _results()
    results["runs"]["vramcal"][1]["process_wall_s"] = 40.0
    results["runs"]["vramcal"][2]["process_wall_s"] = 35.0  # 20 / 40 / 35 s: median 35 s, 0.35x binsearch's 100 s
    assert {t["target"]: t for t in targets(results)}[WALL]["met"] == "**no**"


def test_a_safe_size_above_the_truth_or_a_missing_survival_run_is_reported():
    results = _results()
    results["runs"]["vramcal"][0]["limits"]["safe_batch_size"] = 201
    results["survival"] = [s for s in results["survival"] if s["batch_size"] != 120]
    by_target = {t["target"]: t for t in targets(results)}
    assert by_target["vramcal: safe batch size never above the ground truth"]["met"] == "**no**"
    assert by_target["vramcal: 200 training steps at the safe size finish with no out-of-memory error"]["met"] == "-"
    conservative = by_target[CONSERVATIVE_PEAK]
    assert conservative["met"] == "-" and "not run" in conservative["measured"]


def test_every_answer_of_every_round_and_each_safe_size_needs_a_survival_run():
    sizes = needs_survival(_results())
    assert sorted(sizes) == [120, 121, 134, 135, 190]
    assert sizes[120] == ["vramcal conservative r1", "vramcal conservative r2"]
    assert sizes[190] == ["lightning-binsearch r1", "lightning-binsearch r2", "lightning-binsearch r3",
                          "accelerate r1", "accelerate r3"]


def test_survive_picks_only_vramcals_safe_or_conservative_sizes_and_the_page_says_so():
    results = _results()
    assert survival_sizes(results) == needs_survival(results)
    assert sorted(survival_sizes(results, "safe")) == [134, 135]
    assert sorted(survival_sizes(results, "conservative")) == [120, 121]
    with pytest.raises(ValueError, match="--survive 'answers': use one of all, safe, conservative"):
        survival_sizes(results, "answers")
    assert "1000 optimizer steps" not in markdown(results) and "at each answer" in markdown(results)
    assert "at vramcal's safe sizes only (--survive safe)" in markdown({**results, "survive": "safe"})
    with pytest.raises(SystemExit):  # argparse refuses another value with one line, exit 2
        parse_args(["--survive", "answers"])


def test_the_page_renders_rounds_and_survival_and_refuses_old_results():
    page = markdown(_results())
    assert "| vramcal safe | 3 | 25.0 | 20.0-30.0 | 6 | 134 / 134 / 135 (differ) | -33.0 | yes |" in page
    assert "| 190 | x | oom-fallback | 40/200 |" in page
    with pytest.raises(ResultsError, match="rerun"):
        markdown({k: v for k, v in _results().items() if k != "bench_schema"})


def test_round_orders_are_seeded_permutations():
    tools = ["vramcal", "vramcal-anchor-margin", "lightning-binsearch", "lightning-power", "accelerate"]
    orders = round_orders(tools, 3, seed=0)
    assert orders == round_orders(tools, 3, seed=0)
    assert all(sorted(order) == sorted(tools) for order in orders)
    assert len({tuple(order) for order in orders}) > 1
    assert orders != round_orders(tools, 3, seed=1)


def test_bisection_finds_the_largest_fitting_size_and_tries_these_sizes():
    tried = []

    def fits(batch_size: int) -> bool:
        tried.append(batch_size)
        return batch_size <= 37

    assert bisect_largest(fits) == (37, 38)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert bisect_largest(lambda b: False) == (0, 1)


def test_the_cached_truth_is_used_only_for_the_same_key():
    key = {"spec": {"d_model": 64}, "budget_bytes": 1, "vramcal_commit": "abc"}
    old = {"ground_truth": {"batch_size": 200, "key": key}}
    assert cached(old, dict(key))["batch_size"] == 200
    assert cached(old, {**key, "vramcal_commit": "def"}) is None
    assert cached({}, key) is None


def test_sizing_at_any_size_gives_the_profiles_prediction_there_without_clamping():
    profile = host_profile()
    safe = profile.limits.safe_batch_size
    above = sizing_at(profile, safe + 50)
    assert above.batch_size == safe + 50
    assert above.predicted_peak_bytes == int(profile.fit.predict(safe + 50))
    assert above.upper_bytes == int(profile.fit.upper(safe + 50))
    within = sizing_at(profile, safe - 1)
    # every size trains whole steps of itself, one micro-batch each (the safe size's sizing it starts from had the
    # safe size as its step: below it a run then accumulated micro-batches, above it trained the safe size)
    assert (within.effective_batch_size, within.accumulation_steps) == (safe - 1, 1)
    assert (above.effective_batch_size, above.accumulation_steps) == (safe + 50, 1)
    reference = size(profile, SizeRequest(request=safe - 1))
    assert (within.predicted_peak_bytes, within.upper_bytes) == (reference.predicted_peak_bytes,
                                                                 reference.upper_bytes)
    more_data = sizing_at(profile, safe - 1, pool_data_bytes=profile.pool_data_bytes + 10 * MIB)
    assert more_data.predicted_peak_bytes == reference.predicted_peak_bytes + 10 * MIB


def test_an_out_of_memory_fallback_is_not_survival():
    assert outcome(200, 200, 0, None) == "ok"
    assert outcome(200, 54, 1, None) == "oom-fallback"
    assert outcome(200, 3, 0, "the training process ran out of memory (...)") == "oom"
    assert outcome(200, 3, 0, "the training process failed (ValueError: x)") == "error"
    assert outcome(200, 150, 0, None) == "error"


def test_tiled_bars_keep_each_copy_apart():
    bars = synthetic_bars(500)
    tiled = tile_bars(bars, 3)
    assert len(tiled) == 1500 and tiled["timestamp"].is_monotonic_increasing
    three = make_windows(tiled, 32, stride=1, val_fraction=0.2)
    # A window never spans the week between copies: a copy of 500 bars gives 500 - 2 rows, so 467 windows
    # of 32, and the train/validation split (inside the last copy) loses fewer than 32 more; windows across
    # the copies would give up to 1500 - 2 - 31 = 1467.
    assert len(three.train_starts) + len(three.val_starts) in range(3 * 467 - 31, 3 * 467 + 1)


def test_data_in_host_memory_leaves_the_gpu_prediction_unchanged_and_device_data_counts():
    profile = host_profile()
    result = gpu_path(profile, {"host": 0, "device": 5 * MIB}, {"host": 0, "device": 50 * MIB})
    assert result["host"]["unchanged"]
    assert result["device"]["predicted_large"] - result["device"]["predicted_1x"] == 45 * MIB
    assert not result["device"]["unchanged"]


def test_python_versions_agree_when_each_peak_lies_in_the_others_interval():
    sizes = [1, 8, 32, 64, 100]
    line = [500 * MIB + 5 * MIB * b for b in sizes]
    fit_a = fit_linear(sizes, [p + d for p, d in zip(line, (2, -3, 1, 2, -2))])
    fit_b = fit_linear(sizes, [p + d * MIB for p, d in zip(line, (1, -1, 2, -2, 0))])
    shifted = dataclasses.replace(fit_b, overhead_bytes=fit_b.overhead_bytes + 200 * MIB)
    a = Calibration("3.11", 100, 90, int(fit_a.predict(100)), True, fit_a)
    b = Calibration("3.12", 100, 90, int(fit_b.predict(100)), True, fit_b)
    c = Calibration("3.13", 100, 90, int(shifted.predict(100)), True, shifted)
    pairs = {(p["version"], p["against"]): p["inside"] for p in agreement([a, b, c])}
    assert pairs[("3.11", "3.12")] and pairs[("3.12", "3.11")] is False  # 3.11's interval is tight
    assert pairs[("3.13", "3.12")] is False and pairs[("3.11", "3.13")] is False


class ScriptedRunner:
    """A trial runner at the hardware boundary: each size's trials come from ``outcomes[size]`` in turn
    (``(status, peak_bytes)``), else ok within the budget up to ``largest``, out of memory above it."""

    def __init__(self, budget_bytes: int, largest: int, outcomes: dict[int, list[tuple[str, int | None]]]) -> None:
        self.budget_bytes, self.largest, self.outcomes, self.sizes = budget_bytes, largest, outcomes, []

    def run(self, request, purpose=""):
        from vramcal.records import Trial

        size = request.batch_size
        self.sizes.append(size)
        if self.outcomes.get(size):
            status, peak = self.outcomes[size].pop(0)
        else:
            status, peak = ("ok", self.budget_bytes // 2) if size <= self.largest else ("oom", None)
        return (Trial(size, status, peak, purpose=purpose, wall_s=0.1,
                      error=None if status == "ok" else f"Traceback ...\nRuntimeError: {status} at {size}"),)


TRUTH_SPEC = {"d_model": 32, "n_layers": 1, "d_state": 16, "headdim": 16, "chunk_size": 16, "seq_len": 32}


def test_the_truth_is_decided_by_memory_alone_and_an_error_near_the_limit_is_retried_once():
    from bench.truth import ground_truth

    budget = 1024 * MIB
    # 40 times out, then runs out of memory; 38 errs, then fits; 39 finishes but peaks above the budget: no fit
    runner = ScriptedRunner(budget, 37, {40: [("timeout", None)], 38: [("error", None), ("ok", budget - 1)],
                                         39: [("ok", budget + 1)]})
    truth = ground_truth(TRUTH_SPEC, budget, "bars.parquet", 1, runner=runner, echo=lambda line: None)
    assert (truth["batch_size"], truth["first_failing_batch_size"]) == (38, 39)
    assert runner.sizes == [1, 2, 4, 8, 16, 32, 64, 48, 40, 40, 36, 38, 38, 39]
    assert [(t["batch_size"], t["status"]) for t in truth["non_oom_failures"]] == [(40, "timeout"), (38, "error")]


def test_a_size_that_errs_twice_never_becomes_the_truth():
    from bench.truth import TruthError, ground_truth

    budget = 1024 * MIB
    runner = ScriptedRunner(budget, 37, {48: [("error", None), ("timeout", None)]})
    with pytest.raises(TruthError, match=r"^batch size 48 ended in timeout twice \(RuntimeError: timeout at 48\): "):
        ground_truth(TRUTH_SPEC, budget, "bars.parquet", 1, runner=runner, echo=lambda line: None)
    assert runner.sizes == [1, 2, 4, 8, 16, 32, 64, 48, 48]


def test_memory_verdict():
    from bench.truth import memory_verdict

    assert [memory_verdict(status, peak, 100) for status, peak in
            [("ok", 100), ("ok", 101), ("oom", None), ("error", None), ("timeout", None), ("ok", None)]] == [
        "fits", "over", "over", "unknown", "unknown", "unknown"]


def test_the_creep_policy_replays_other_curves_against_their_own_run_length(tmp_path, capsys, monkeypatch):
    """``bench.creep_policy --curves FILE --run-steps N``: a curve flat after its third step, then one late rise of
    1 %, is stopped by the plateau at step 3 + plateau_steps and predicted with the allowance; a curve shorter
    than the run is left out."""
    import gzip
    import json
    import sys

    from bench import creep_policy

    flat_then_late = [800 * MIB, 805 * MIB, 810 * MIB] + [810 * MIB] * 96 + [818.1 * MIB]  # 100 steps
    curves = tmp_path / "curves.json.gz"
    with gzip.open(curves, "wt") as out:
        json.dump({"source": "synthetic", "runs": [
            {"run_id": "a", "spec": "small", "batch_size": 160, "step_peak_bytes": [round(p) for p in flat_then_late]},
            {"run_id": "b", "spec": "long", "batch_size": 16, "step_peak_bytes": [800 * MIB] * 50}]}, out)
    monkeypatch.setattr(sys, "argv", ["creep_policy", "--curves", str(curves), "--run-steps", "100",
                                      "--plateau-steps", "5", "--allowance", "0.005"])
    assert creep_policy.main() == 0
    printed = capsys.readouterr().out
    assert "1 curves of 100 steps" in printed
    row = next(line for line in printed.splitlines() if line.startswith("small"))
    assert row.split() == ["small", "160", "8", "810.0", "814.0", "818.1", "+0.50%"]  # (818.1 - 814.05) / 814.05
    monkeypatch.setattr(sys, "argv", ["creep_policy", "--curves", str(curves), "--run-steps", "1000"])
    assert creep_policy.main() == 2
    assert "has 1000 steps (the longest has 100): give a smaller --run-steps" in capsys.readouterr().err


def test_creep_curves_records_a_real_steady_trials_peak_after_every_step(tmp_path, monkeypatch, capsys):
    """``bench.creep_curves --out FILE --data BARS SPEC:BATCH:STEPS``: one real steady trial of a tiny spec with the
    plateau stop off, every asked step's peak written where ``bench.creep_policy --curves`` reads it."""
    import gzip
    import json
    import sys

    from host_budget import budget
    from test_train_data import synthetic_bars

    from bench import creep_curves
    from bench.specs import BenchSpec
    from vramcal.models.regressor.spec import RegressorSpec

    bars = tmp_path / "bars.parquet"
    synthetic_bars(1200).to_parquet(bars)
    tiny = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, seq_len=32, chunk_size=16)
    monkeypatch.setitem(creep_curves.SPECS, "tiny", BenchSpec("tiny", tiny, str(budget(1536 * MIB))))
    out = tmp_path / "curves.json.gz"
    monkeypatch.setattr(sys, "argv", ["creep_curves", "--out", str(out), "--data", str(bars), "tiny:4:7"])
    creep_curves.main()
    assert "tiny at 4: 7 steps" in capsys.readouterr().out
    (run,) = json.loads(gzip.open(out, "rt").read())["runs"]
    peaks = run["step_peak_bytes"]
    assert (run["spec"], run["batch_size"], len(peaks), len(run["step_times_s"])) == ("tiny", 4, 7, 7)
    assert peaks == sorted(peaks) and peaks[0] > 100 * MIB  # a peak so far after each step: never falls


def test_epoch_end_reads_the_peak_after_each_part_of_an_epochs_end(tmp_path, monkeypatch, capsys):
    """``bench.epoch_end SPEC BATCH --steps N --partial P --val-chunks K --order ...``: a real worker of a tiny spec,
    the peak after its steps and after each part (a partial batch, validation, a checkpoint, more steps)."""
    import json
    import sys

    from host_budget import budget
    from test_train_data import synthetic_bars

    from bench import epoch_end
    from bench.specs import BenchSpec
    from vramcal.models.regressor.spec import RegressorSpec

    bars = tmp_path / "bars.parquet"
    synthetic_bars(1200).to_parquet(bars)
    tiny = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, seq_len=32, chunk_size=16)
    monkeypatch.setitem(epoch_end.SPECS, "tiny", BenchSpec("tiny", tiny, str(budget(1536 * MIB))))
    monkeypatch.setattr(sys, "argv", ["epoch_end", "tiny", "8", "--steps", "2", "--partial", "3", "--val-chunks", "2",
                                      "--order", "partial,validate,save,steps:2", "--data", str(bars)])
    epoch_end.main()
    out = capsys.readouterr().out
    peaks = json.loads(out.splitlines()[-1])
    assert [label for label, _ in peaks] == ["2 steps", "partial", "validate", "save", "steps:2"]
    values = [peak for _, peak in peaks]
    assert values == sorted(values) and values[0] > 100 * MIB  # the peak so far: never falls
    assert "+0 B (+0.00 %)" in out.splitlines()[0]  # each line against the first reading
    monkeypatch.setattr(sys, "argv", ["epoch_end", "tiny", "8", "--order", "partial,stpes:2"])
    with pytest.raises(SystemExit) as exit_info:  # a typo is refused before any worker starts
        epoch_end.main()
    assert exit_info.value.code == 2 and "unknown event 'stpes:2'" in capsys.readouterr().err


def _timed_round(wall_s: float, boundary_s: tuple[float, ...], safe_s: tuple[float, ...], conservative_s: float,
                 steady_s: float) -> dict:
    """A vramcal round whose trials took these seconds: batch 1 ends at 6 s, a grow trial, the boundary trials,
    verifications at the safe size 90 (and one at 86, an earlier safe size), the steady trial at 81."""
    def trial(b: int, purpose: str, s: float, end: float = 0.0) -> dict:
        return {"batch_size": b, "purpose": purpose, "wall_s": s, "end_s": end, "status": "ok"}

    trials = [trial(1, "grow", 6.0, 6.0), trial(40, "grow", 3.0), *(trial(150, "boundary", s) for s in boundary_s),
              trial(86, "verify-safe", 1.0), *(trial(90, "verify-safe", s) for s in safe_s),
              trial(81, "verify-conservative", conservative_s), trial(81, "steady", steady_s)]
    return {"trials": trials, "process_wall_s": wall_s, "answer_s": wall_s - 2.0,
            "limits": {"safe_batch_size": 90, "conservative_batch_size": 81}}


def test_the_wall_time_floor_prices_one_trial_of_each_kind_from_the_recorded_rounds(tmp_path, capsys):
    from bench.wall_floor import floors, main, parts

    one = parts(_timed_round(60.0, (12.0, 9.0), (8.0, 7.0), 5.0, 20.0))
    assert one == {"start": 8.0, "boundary": 9.0, "safe": 7.0, "conservative": 5.0, "steady": 15.0}
    results = {"spec_name": "default", "runs": {
        "vramcal": [_timed_round(60.0, (12.0, 9.0), (8.0, 7.0), 5.0, 20.0),
                    _timed_round(70.0, (11.0,), (9.0,), 6.0, 22.0),
                    _timed_round(65.0, (10.0,), (7.5,), 7.0, 21.0)],
        "lightning-binsearch": [{"process_wall_s": s} for s in (100.0, 90.0, 120.0)]}}
    (row,) = floors(results)
    assert row["floor"] == pytest.approx(8.0 + 10.0 + 7.5 + 7.0)  # the median of the rounds' sums 29, 34, 32.5
    assert row["with_creep"] == pytest.approx(32.5 + 14.0)  # 44, 50, 46.5
    assert row["measured"] == 65.0 and row["target"] == pytest.approx(0.33 * 100.0)
    path = tmp_path / "default.json"
    path.write_text(json.dumps(results))
    assert main([str(path)]) == 0 and "| default | vramcal | 3 |" in capsys.readouterr().out
    del results["runs"]["lightning-binsearch"]
    path.write_text(json.dumps(results))
    assert main([str(path)]) == 2 and "no lightning-binsearch rounds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no verification at the safe size 90"):
        parts({**_timed_round(60.0, (9.0,), (), 5.0, 20.0)})


def test_survival_runs_train_only_the_kind_asked_for_for_real(tmp_path):
    """``bench.compare --survive conservative``'s path: the tiny spec's conservative size trains for real (two
    steps) beside the profile's prediction; the safe size does not train. (The profile is synthetic: its
    prediction is not the tiny model's, only where it comes from is checked.)"""
    path = training_folder(tmp_path)
    results = {"runs": {"vramcal": [{**_vramcal_run(1, 10.0, conservative=3, safe=4, boundary=20.0),
                                     "profile_path": str(path)}]}}
    saved = []
    (run,) = survival_runs(results, SPEC.to_dict(), 2**31, str(tmp_path / "bars.parquet"), stride=1, steps=2,
                           workers=None, save=lambda: saved.append(True), kinds="conservative")
    assert (run["batch_size"], run["status"], run["steps_done"]) == (3, "ok", 2)
    assert run["sources"] == ["vramcal conservative r1"] and saved == [True]
    assert run["peak_bytes"] > 0 and run["epoch_peak_bytes"]  # measured by the runner's meter
    assert run["predictions"]["vramcal/r1"]["predicted_peak_bytes"] == run["predicted_peak_bytes"]


def test_the_interpolation_bench_measures_each_gap_of_a_profile_between_its_lengths():
    """bench/interpolation.py (issue 59 item 3) measures the 2-D fit where it interpolates: in each gap between
    calibrated lengths, the middle at its safe batch and the longest seq_len at a batch between the ends', beside a
    calibrated control; here the points it picks on the committed 640 MiB profile of the issue's +7.0 % answer."""
    from pathlib import Path

    from bench.interpolation import REPO, multi_length, points

    found = {str(p.path.relative_to(REPO)): p for p in multi_length([REPO / "bench" / "results"])}
    profile = found["bench/results/lm-train/profiles/host-amd-epyc-2-cores/lm-transformers-9f5b73fd-640mib.json"]
    assert points(profile) == [("control", 19, 256), ("middle", 39, 128), ("longest", 38, 128), ("middle", 9, 512),
                               ("longest", 8, 624)]  # the answer: the longest seq_len at batch_size 8
    assert all(p.surface is not None for p in found.values()) and len(found) >= 4
    assert Path(REPO / "bench" / "results" / "interpolation" / "README.md").exists()
