"""The Lightning callback on the CPU: a real Trainer.fit of a tiny LightningModule wrapping a user model."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings

import pytest
import torch
from host_budget import SIZE
from lightning.pytorch import LightningDataModule, LightningModule, Trainer  # the dev extra installs lightning
from torch.utils.data import DataLoader, TensorDataset
from user_models import MLP

from vramcal.measure.device import host_device
from vramcal.measure.meters import host_held_bytes, host_peaks
from vramcal.profile import load_profile, profile_path, save_profile
from vramcal.records import Device
from vramcal.sizing import SizingError
from vramcal.units import format_bytes

from profiles_for_tests import build_profile, host_trial

MIB = 2**20
N_FEATURES = 16


def profile_here(verify: bool = True, held_bytes: int | None = None, total_bytes: int = 8 * 2**30):
    """A profile of this host: 600 MiB + 100 MiB per sample, so safe is about 60 and conservative about 54;
    its trials held ``held_bytes`` when their step was built (the process term's baseline; default: what this
    process holds now, so the process term is what a fit adds to it, whatever earlier tests left here)."""
    held_bytes = host_held_bytes() if held_bytes is None else held_bytes
    trials = [host_trial(b, 600 * MIB + 100 * MIB * b + (i % 2) * MIB, held_bytes=held_bytes)
              for i, b in enumerate((1, 2, 4, 8, 16))]
    return build_profile(host_device(total_bytes), trials, verify=verify)


def dataset(n: int = 256) -> TensorDataset:
    x = torch.randn(n, N_FEATURES)
    return TensorDataset(x, x[:, :1].clone())


class Regressor(LightningModule):
    """A user model in a LightningModule; it records the batch sizes it trained on."""

    def __init__(self, batch_size: int = 1, with_loader: bool = True) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.with_loader = with_loader
        self.net = MLP(N_FEATURES, 8)
        self.seen: set[int] = set()
        self.calls = 0
        self.rss_at_fit_start = None

    def training_step(self, batch, batch_index):
        x, y = batch
        self.seen.add(x.shape[0])
        self.calls += 1
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_fit_start(self) -> None:  # runs after the callbacks' on_fit_start (their reset)
        self.held_at_fit_start = host_held_bytes()

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size) if self.with_loader else None


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()  # batch_size lives in hparams only

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)


def fit(module, callback, tmp_path, datamodule=None) -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tmp_path, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|log_every_n_steps|treespec).*")
        trainer.fit(module, datamodule=datamodule)
    return trainer


def test_sets_the_conservative_size_and_reports_the_measured_peak(tmp_path, caplog):
    from vramcal.integrations.lightning import VramcalBatchSize

    profile = profile_here()
    path = save_profile(profile, tmp_path / "host.json")
    callback, module = VramcalBatchSize(path), Regressor()
    with caplog.at_level(logging.INFO):
        fit(module, callback, tmp_path)
    conservative = profile.limits.conservative_batch_size
    assert 1 < conservative < profile.limits.safe_batch_size
    assert module.batch_size == conservative and module.seen == {conservative}
    assert callback.sizing.source == "conservative" and callback.profile_source == str(path)
    # the process term: what this process held at fit start against the trials' 600 MiB, in the prediction
    assert callback.run.held_bytes > 0
    assert callback.sizing.process_delta_bytes == callback.run.held_bytes - profile.held_bytes
    assert callback.sizing.predicted_peak_bytes == int(profile.fit.predict(conservative)
                                                       + callback.sizing.process_delta_bytes)
    observed = load_profile(path).observations[-1]
    assert observed.framework == "lightning" and observed.peak_bytes == callback.peak_bytes
    assert observed.process_delta_bytes == callback.sizing.process_delta_bytes and observed.steps == 2
    # the peak is this process's: at least what it held at fit start, at most its peak since
    assert module.held_at_fit_start <= callback.peak_bytes <= host_peaks()["peak_bytes"]
    assert f"peak {format_bytes(callback.peak_bytes)} at batch_size {conservative}: predicted " \
           f"{format_bytes(callback.sizing.predicted_peak_bytes)}" in callback.report
    assert "host peak" in callback.report
    assert callback.report in caplog.text
    assert f"batch_size = {conservative} (conservative" in caplog.text
    assert caplog.text.count("vramcal: batch_size = ") == 1  # said at setup; fit start kept it (issue 42 item 7)


def test_a_process_holding_more_than_the_trials_gets_a_smaller_batch(tmp_path, caplog):
    """The trials held 10 MiB at the start of training (a fiction of this test): this process holds hundreds
    more, which leave less room for samples, so the limits come down and the batch is set again at fit
    start, before the dataloaders are built, and said again."""
    profile = profile_here(held_bytes=10 * MIB)
    from vramcal.integrations.lightning import VramcalBatchSize

    callback, module = VramcalBatchSize(profile, limit="safe"), Regressor()
    with warnings.catch_warnings(record=True) as warned, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        fit(module, callback, tmp_path)
    # issue 59 item 9: one line, in vramcal's voice, says the size and why it is not setup's (no UserWarning)
    said = [line for line in caplog.text.splitlines() if "vramcal: batch_size = " in line]
    assert len(said) == 1 and f"batch_size = {callback.sizing.batch_size} (safe" in said[0], said
    assert re.search(rf"; down from {profile.limits.safe_batch_size}: this process holds \+{SIZE} against the "
                     rf"trials' \(the process term\) and the gradients \+\d", said[0]), said[0]
    assert re.search(r"this process holds .* a process term of \+\d", caplog.text), caplog.text
    assert not any("batch_size" in str(w.message) for w in warned), [str(w.message) for w in warned]
    assert callback.sizing.safe_batch_size < profile.limits.safe_batch_size
    assert module.seen == {callback.sizing.batch_size} and module.batch_size == callback.sizing.safe_batch_size


def test_automatic_optimization_adds_the_gradients_to_the_prediction(tmp_path, caplog):
    """Lightning zeroes the gradients after the next forward pass: the profile's gradient bytes join the
    prediction and the limits; under manual optimization (the module's own order) they do not."""
    import dataclasses

    from vramcal.integrations.lightning import VramcalBatchSize
    from vramcal.sizing import SizeRequest, size

    profile = profile_here()
    profile = dataclasses.replace(profile, model_info={**profile.model_info, "gradient_bytes": 150 * MIB})
    callback = VramcalBatchSize(profile, limit="safe")
    with caplog.at_level(logging.INFO):  # information: logged, not warned
        fit(Regressor(), callback, tmp_path)
    assert re.search(r"held through the forward pass \(Lightning's automatic optimization .*\): a gradient term of "
                     r"\+150.00 MiB", caplog.text), caplog.text
    s, plain = callback.sizing, size(profile, SizeRequest(limit="safe"), process_bytes=callback.run.held_bytes)
    assert s.gradient_delta_bytes == 150 * MIB and s.safe_batch_size < plain.safe_batch_size
    assert s.predicted_peak_bytes == int(profile.fit.predict(s.batch_size) + s.process_delta_bytes + 150 * MIB)
    assert "gradient term +150.0 MiB" in callback.report

    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, index):
            optimizer = self.optimizers()
            optimizer.zero_grad(set_to_none=True)
            self.manual_backward(super().training_step(batch, index))
            optimizer.step()

    manual = VramcalBatchSize(profile, limit="safe")
    fit(Manual(), manual, tmp_path)
    assert manual.sizing.gradient_delta_bytes == 0 and "gradient term" not in manual.report


def test_an_effective_batch_is_kept_with_accumulation(tmp_path):
    """A request for 200 samples per step with a conservative micro-batch about 55: 4 micro-batches of 50."""
    from vramcal.integrations.lightning import VramcalBatchSize

    callback, module = VramcalBatchSize(profile_here(), effective_batch_size=200), Regressor()
    trainer = fit(module, callback, tmp_path)
    s = callback.sizing
    assert s.effective_batch_size == 200 and (s.accumulation_steps - 1) * s.batch_size < 200
    assert s.accumulation_steps * s.batch_size >= 200 and s.batch_size <= profile_here().limits.conservative_batch_size
    assert max(module.seen) == s.batch_size  # (the epoch's last batch is what is left of the 256 samples)
    assert trainer.accumulate_grad_batches == s.accumulation_steps == 4
    assert module.calls == 6  # the epoch's 6 batches: an optimizer step after 4 and one at the epoch's end


def test_clamps_a_request_on_the_datamodules_hparams_with_a_warning(tmp_path):
    from vramcal.integrations.lightning import VramcalBatchSize

    profile = profile_here()
    data, module = Data(batch_size=3), Regressor(with_loader=False)
    del module.batch_size  # only the DataModule's hparams hold it
    callback = VramcalBatchSize(profile, request=10_000)
    with pytest.warns(UserWarning, match=r"request=10000 is outside \[1, \d+\] \(batch_size_min=, "):
        fit(module, callback, tmp_path, datamodule=data)
    safe = profile.limits.safe_batch_size
    assert data.hparams.batch_size == safe and module.seen == {safe}
    assert callback.sizing.source == "clamped"


def test_warns_for_an_unverified_profile(tmp_path):
    from vramcal.integrations.lightning import VramcalBatchSize

    profile = profile_here(verify=False)
    assert not profile.verified
    with pytest.warns(UserWarning, match="not verified by real trials"):
        fit(Regressor(), VramcalBatchSize(profile, request=5), tmp_path)


def test_finds_the_profile_by_model_in_a_profiles_folder(tmp_path):
    from vramcal.integrations.lightning import VramcalBatchSize

    profile = profile_here()  # made for the bundled regressor at its defaults, transformers implementation
    path = save_profile(profile, profile_path(tmp_path / "profiles", profile.device, profile.model, "transformers"))
    callback, module = VramcalBatchSize(model="regressor", params={}, profiles_dir=tmp_path / "profiles"), Regressor()
    fit(module, callback, tmp_path)
    assert callback.profile_source == str(path) and module.seen == {profile.limits.conservative_batch_size}


def test_refuses_in_one_line(tmp_path):
    from vramcal.integrations.lightning import VramcalBatchSize
    from vramcal.integrations.run import FrameworkRun

    with pytest.raises(ValueError, match="needs profile=.*or model="):  # the callbacks calibrate the module itself
        FrameworkRun()
    elsewhere = build_profile(Device(kind="host", name="Another CPU (64 cores)", total_bytes=8 * 2**30,
                                     total_source="MemAvailable"), [host_trial(b, (600 + 100 * b) * MIB)
                                                                    for b in (1, 2, 4, 8)])
    with pytest.raises(SizingError, match=r"made on another device .*'Another CPU \(64 cores\)'") as error:
        fit(Regressor(), VramcalBatchSize(elsewhere), tmp_path)
    assert "\n" not in str(error.value)
    with pytest.raises(SizingError, match="the given profile: the profile was made for another model: d_model=64"):
        fit(Regressor(), VramcalBatchSize(profile_here(), model="regressor", params={"d_model": 64}), tmp_path)
    module = Regressor()
    with pytest.raises(ValueError, match="neither the LightningModule nor its DataModule has 'bs'"):
        fit(module, VramcalBatchSize(profile_here(), attr="bs"), tmp_path)
    with pytest.raises(SizingError, match="no profile for .* run `vramcal probe"):
        fit(module, VramcalBatchSize(model="regressor", profiles_dir=tmp_path / "empty"), tmp_path)


def test_importing_vramcal_does_not_import_lightning():
    code = ("import sys, vramcal, vramcal.api; vramcal.batch_size; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
