"""The trial journal (issue 25, item 7a): a calibration cut short keeps its trials, and the same calibration run
again reuses them; another calibration's journal, or trials that measured nothing, are not reused. The
measurement is faked at the hardware boundary (tests/test_documented.py: fake_measurement); the search, the
journal, the limits and the files are real. A full disk, for real, is in tests/test_faults.py."""

from __future__ import annotations

import json

import pytest
from host_budget import capacity
from test_documented import fake_measurement, known_line
from test_train import SPEC

from vramcal import api
from vramcal.measure.device import host_device
from vramcal.profile import load_profile
from vramcal.service.journal import Journal, journal_path, plan_key
from vramcal.units import parse_bytes


def plan(tmp_path, **changes):
    device = host_device(parse_bytes(capacity(3 * 2**30 // 2)))
    return api.plan_calibration(SPEC.ref("transformers"), device=device, implementation="transformers",
                                **{"out": tmp_path / "p.json", **changes})


class Stop(Exception):
    pass


def counted(monkeypatch, peak=known_line):
    """Fake trials, counted: the trials that ran for real."""
    ran = []

    def measured(b, purpose):
        ran.append((b, purpose))
        return peak(b, purpose)

    fake_measurement(monkeypatch, measured)
    return ran


def stop_after(n: int):
    seen = []

    def on_trial(trial):
        seen.append(trial)
        if len(seen) == n:
            raise Stop  # as a kill after the n-th trial would

    return on_trial


def test_a_calibration_cut_short_is_finished_from_its_journal(tmp_path, monkeypatch):
    ran = counted(monkeypatch)
    straight = api.run_calibration(plan(tmp_path / "straight"))
    everything = list(ran)
    ran.clear()
    with pytest.raises(Stop):
        api.run_calibration(plan(tmp_path), on_trial=stop_after(4))
    journal = journal_path(tmp_path / "p.json")
    assert len(json.loads(journal.read_text())["trials"]) == 4 and not (tmp_path / "p.json").exists()
    ran.clear()
    notices = []
    profile = api.run_calibration(plan(tmp_path), on_notice=notices.append)
    assert notices == [f"4 trial(s) of an earlier run of this calibration are in {journal}: they are reused while "
                       f"the search asks for them"]
    assert ran == everything[4:]  # only the trials the journal did not hold ran
    assert [t.batch_size for t in profile.trials] == [t.batch_size for t in straight.trials]
    assert profile.limits == straight.limits and not journal.exists()
    assert load_profile(tmp_path / "p.json").limits == straight.limits


def test_a_steady_trial_that_verifies_is_journaled_and_replayed_as_its_two_records(tmp_path, monkeypatch):
    """One process, two records (its first steps verify the conservative size): killed between them, the journal
    holds both, and a rerun replays both instead of running the steady trial again."""
    ran = counted(monkeypatch)
    straight = api.run_calibration(plan(tmp_path / "straight"))
    pairs = [(t.batch_size, t.purpose) for t in straight.trials]
    at = pairs.index((straight.limits.conservative_batch_size, "verify-conservative"))
    assert pairs[at + 1] == (pairs[at][0], "steady")
    ran.clear()
    with pytest.raises(Stop):
        api.run_calibration(plan(tmp_path), on_trial=stop_after(at + 1))  # after the first of the two
    journal = journal_path(tmp_path / "p.json")
    assert [t["purpose"] for t in json.loads(journal.read_text())["trials"]][at:] == ["verify-conservative", "steady"]
    ran.clear()
    profile = api.run_calibration(plan(tmp_path))
    assert (pairs[at][0], "steady") not in ran and profile.limits == straight.limits


def test_another_calibrations_journal_is_replaced_and_unmeasured_trials_run_again(tmp_path, monkeypatch):
    ran = counted(monkeypatch)
    with pytest.raises(Stop):
        api.run_calibration(plan(tmp_path), on_trial=stop_after(3))
    other = plan(tmp_path, settings=api.LimitSettings(margin=0.2))
    opened = Journal.open(journal_path(other.path), plan_key(other))
    assert opened.kept == [] and "is of another calibration" in opened.notice
    # a journal whose second trial ended in an error: only the first is reused (the step may be fixed now)
    journal = journal_path(tmp_path / "p.json")
    data = json.loads(journal.read_text())
    data["trials"][1].update(status="error", peak_bytes=None, error="RuntimeError: boom")
    journal.write_text(json.dumps(data))
    assert len(Journal.open(journal, plan_key(plan(tmp_path))).kept) == 1
    ran.clear()
    api.run_calibration(plan(tmp_path))
    assert ran[0][0] == data["trials"][1]["batch_size"]  # the errored size ran again, for real


def test_a_first_trial_that_fails_leaves_no_journal_and_no_folders(tmp_path, monkeypatch):
    counted(monkeypatch, lambda b, purpose: None)  # nothing fits
    target = plan(tmp_path, out=tmp_path / "deep" / "er" / "p.json")
    with pytest.raises(api.CalibrationError):
        api.run_calibration(target)
    assert list(tmp_path.iterdir()) == []
