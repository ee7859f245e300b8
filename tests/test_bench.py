"""The benchmark's pure parts (tables, ratios, answers) on a synthetic results dict; no Lightning needed."""

from __future__ import annotations

from bench.compare import _answers
from bench.table import markdown, ratios, rows


def _results() -> dict:
    trial = {"batch_size": 1, "status": "ok"}
    return {
        "spec_name": "small", "spec": {"d_model": 64}, "steps": 50, "accelerate_start": 1024,
        "environment": {"budget": "1.50 GiB", "budget_bytes": 1610612736, "machine": "cpu", "cpus": 2,
                        "platform": "linux", "versions": {"torch": "2.13.0"}, "limit": "RLIMIT_DATA",
                        "created_utc": "2025-01-01T00:00:00Z", "load_average_start": [1.0, 1.0, 1.0]},
        "limit_check": {"binds": True, "recognised_by_all": True},
        "ground_truth": {"batch_size": 200, "first_failing_batch_size": 201, "trials": [trial] * 10, "wall_s": 90.0},
        "tools": {
            "vramcal": {"answer": 120, "trials": [trial] * 6, "process_wall_s": 30.0, "returncode": 0,
                        "limits": {"conservative_batch_size": 120, "safe_batch_size": 134,
                                   "boundary_batch_size": 204.0, "usable_bytes": 2**29}},
            "lightning-binsearch": {"answer": 190, "trials": [trial] * 12, "process_wall_s": 120.0, "returncode": 0},
            "accelerate": {"answer": 190, "trials": [trial] * 3, "process_wall_s": 60.0, "returncode": 0},
        },
        "survival": {"120": {"status": "ok", "steps_done": 50, "rss_peak_bytes": 2**30},
                     "134": {"status": "ok", "steps_done": 50, "rss_peak_bytes": 2**30},
                     "190": {"status": "oom", "steps_done": 1, "rss_peak_bytes": 2**30}},
    }


def test_rows_give_errors_against_the_truth_and_survival():
    by_tool = {row["tool"]: row for row in rows(_results())}
    assert by_tool["vramcal predicted boundary"]["error_pct"] == "+2.0"
    assert by_tool["vramcal conservative"]["error_pct"] == "-40.0"
    assert by_tool["vramcal conservative"]["survived"] == "yes"
    assert by_tool["lightning-binsearch"]["survived"] == "no (oom at step 1)"
    assert by_tool["accelerate"]["trials"] == 3


def test_ratios_divide_vramcal_by_each_anchor():
    assert ratios(_results()) == [
        {"anchor": "lightning-binsearch", "wall_ratio": "0.25", "trials_ratio": "0.50"},
        {"anchor": "accelerate", "wall_ratio": "0.50", "trials_ratio": "2.00"}]


def test_every_answer_and_the_safe_size_get_a_survival_run():
    assert _answers(_results()) == {120, 134, 190}
    assert "| vramcal safe | 6 | 30.0 | 134 | -33.0 | yes |" in markdown(_results())
