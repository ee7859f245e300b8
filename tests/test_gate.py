"""The gate (issue 44) wherever a size is handed out beyond ``vramcal train`` and ``vramcal size`` (tested in
test_train.py, with a real second process, and test_learned.py): a tuning study's batch range, an
integration's first step, a host DDP rank's share. The device's free memory is faked: the hardware boundary."""

from __future__ import annotations

import pytest
from test_train import SPEC, make_profile, training_folder

from vramcal.integrations import run as framework
from vramcal.measure.device import host_device
from vramcal.train import plan as planning
from vramcal.train.config import TrainConfig
from vramcal.tune import study

MIB = 2**20


@pytest.fixture()
def folder(tmp_path):
    path = training_folder(tmp_path)
    profile = make_profile(host_device())
    room = profile.limits.total_bytes - profile.settings.reserve_bytes
    config = TrainConfig(data=str(tmp_path / "bars.parquet"), spec=SPEC, gpu="none",
                         profiles_dir=str(tmp_path / "profiles"), epochs=1, max_steps=1)
    return {"tmp": tmp_path, "path": path, "profile": profile, "room": room, "config": config}


def test_a_studys_batch_range_ends_below_what_the_device_has_free_now(folder, monkeypatch):
    setting = planning.resolve(folder["config"])
    settings = study.TuneSettings(base=folder["config"])
    full = study.batch_bounds(settings, setting)
    monkeypatch.setattr(study, "free_bytes", lambda device: (folder["room"] - 72 * MIB, "MemAvailable (faked)"))
    gated = study.batch_bounds(settings, setting)
    assert gated.high < full.high == folder["profile"].limits.conservative_batch_size
    assert any("72.00 MiB less than the profile's" in notice for notice in gated.notices)


def test_an_integrations_first_step_is_gated_and_a_resize_keeps_the_gate(folder, monkeypatch):
    """What this process holds is added back: only the others' memory is missing."""
    seen, held = [], []
    monkeypatch.setattr(framework, "attach_meter", lambda device, warn: Meter(held))  # attached when the run is made
    run = framework.FrameworkRun(folder["path"], device="cpu", warn=seen.append, inform=seen.append)
    before = run.sizing.batch_size
    monkeypatch.setattr(framework, "free_bytes", lambda device: (folder["room"] - 72 * MIB, "MemAvailable (faked)"))
    sizing = run.start()
    assert sizing.batch_size < before and sizing.missing_bytes == 72 * MIB - held[0]
    assert any("less than the profile's" in line for line in seen)
    assert any(f"batch_size {before} -> {sizing.batch_size}" in line for line in seen)
    safe = folder["profile"].limits.safe_batch_size
    assert run.resize(safe).batch_size == sizing.safe_batch_size < safe  # clamped again under the gate


class Meter:
    """The process meter at the hardware boundary: this process holds 8 MiB."""

    unseen = None

    def __init__(self, held: list[int]) -> None:
        self.held = held

    def held_bytes(self) -> int:
        self.held.append(8 * MIB)
        return 8 * MIB

    def reset(self) -> None:
        pass


def test_host_ranks_each_take_their_share_of_the_hosts_free_memory(folder, monkeypatch):
    config = folder["config"]
    setting = planning.resolve(config)
    monkeypatch.setattr(planning, "free_bytes", lambda device: (2 * folder["room"] - 2 * 72 * MIB, "MemAvailable"))
    one = planning.plan_run(config, folder["tmp"] / "one", setting, prepare=False)
    rank = planning.plan_run(config, folder["tmp"] / "rank", setting, prepare=False, ranks=2)
    assert one.sizing.missing_bytes == 0
    assert rank.sizing.missing_bytes == 72 * MIB
    assert "MemAvailable, 1/2 of it for each host rank" in " ".join(rank.notices)
