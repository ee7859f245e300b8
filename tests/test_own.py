"""A model the user already has (vramcal.models.own): how a trial process imports its class, and the sample of the
run's data its batches come from."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lightning.pytorch as pl  # the dev extra installs lightning
import pytest
import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from vramcal.models.own import (
    class_path,
    data_shapes,
    import_class,
    refuse_training_at_import,
    sample_batches,
    save_sample,
)
from vramcal.workload import WorkloadError


class Here(torch.nn.Module):
    pass


def test_a_class_is_named_where_another_process_imports_it():
    assert class_path(Here) == "test_own:Here"
    assert import_class("test_own:Here") is Here

    def made_inside() -> type:
        class Local:
            pass
        return Local

    with pytest.raises(WorkloadError, match=r"defined inside a function, so vramcal's trial processes cannot import"):
        class_path(made_inside())
    with pytest.raises(WorkloadError, match=r"^cannot import Nope from test_own \(AttributeError: "):
        import_class("test_own:Nope")


def test_a_scripts_class_is_imported_without_running_the_script(tmp_path):
    """A class of the script Python runs (``__main__``) is named by the script's path; another process imports the
    script as multiprocessing's spawn does, so its ``__main__`` part does not run, and a script that trains at its
    top level is refused in one line (a trial would train instead of building one step)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        from vramcal.models.own import class_path, refuse_training_at_import

        class Model:
            pass

        if "--train-at-import" in sys.argv[1:] or __name__ == "__main__":
            refuse_training_at_import()  # where an integration starts a run
        if __name__ == "__main__":
            print(class_path(Model))
    """))
    named = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.strip()
    assert named == f"{script.resolve()}:Model"
    imported = import_class(named)
    assert imported.__name__ == "Model" and imported.__module__ == "__mp_main__"
    refuse_training_at_import()  # nothing is being imported now
    (tmp_path / "other.py").write_text(script.read_text())
    target = f"{tmp_path / 'other.py'}:Model"
    code = ("import sys; sys.argv.append('--train-at-import'); from vramcal.models.own import import_class; "
            f"import_class({target!r})")
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert refused.returncode == 1
    assert "other.py trains when it is imported, and vramcal's trial processes import it to rebuild the model: put " \
           "its training under `if __name__ == '__main__':`" in refused.stderr


def test_a_sample_keeps_the_batch_and_gives_any_batch_size_from_its_rows(tmp_path):
    from transformers import BatchEncoding

    ids = torch.arange(12).reshape(3, 4)
    batch = BatchEncoding({"input_ids": ids, "labels": ids.clone(), "names": ["a", "b", "c"], "scale": 2.0})
    path = save_sample(batch, tmp_path)
    assert save_sample(batch, tmp_path) == path and len(list(tmp_path.iterdir())) == 1  # one file per content
    assert data_shapes(batch) == [["input_ids", [4], "torch.int64"], ["labels", [4], "torch.int64"]]
    assert data_shapes([ids, (ids.float(),)]) == [["0", [4], "torch.int64"], ["1.0", [4], "torch.float32"]]
    five = sample_batches(path, torch.device("cpu"))(5)
    assert five["input_ids"].tolist() == [ids[i].tolist() for i in (0, 1, 2, 0, 1)]
    assert five["names"] == ["a", "b", "c", "a", "b"] and five["scale"] == 2.0
    with pytest.raises(WorkloadError, match="hold a object: vramcal's trials take tensors"):
        save_sample({"x": ids, "y": object()}, tmp_path)
    with pytest.raises(WorkloadError, match="hold no tensor with rows"):
        save_sample({"names": ["a"]}, tmp_path)
    (tmp_path / "bad.pt").write_text("not a sample")
    with pytest.raises(WorkloadError, match=r"cannot read the sample of the run's data .*bad.pt .*fit again"):
        sample_batches(tmp_path / "bad.pt", torch.device("cpu"))


# ------------------------------------------------------------------------- Lightning and the Trainer, no factory

GIB, MIB = 2**30, 2**20
WIDE = 16384  # features per sample: 64 KiB of input, a narrow net: a budget is reached in well under a second a step


class WideRows(torch.utils.data.Dataset):
    """``n`` samples ``(x: (WIDE,), y: (1,))`` fp32, each drawn from its index (nothing held)."""

    def __init__(self, n: int = 100_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(WIDE, generator=torch.Generator().manual_seed(index))
        return x, x[:1].clone()


def own_budget() -> int:
    """A host budget whose usable memory leaves a trial's process (torch, transformers and Lightning imported) a few
    hundred MiB for samples (tests/host_budget.py)."""
    from host_budget import budget

    return budget(int(1.4 * GIB))


def own_trials():
    import vramcal

    return vramcal.TrialSettings(boundary=False)  # no trial at the out-of-memory edge: quicker


class Wide(pl.LightningModule):
    """A user's module as Lightning users write it, its hyperparameters saved: vramcal's trials rebuild it as
    ``Wide(**hparams)``. It records the batch sizes it trained on; ``spike_at``: the step whose batch it repeats 64
    times (a batch the profile did not predict), once."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        from user_models import MLP

        self.net, self.batch_size = MLP(WIDE, width), 1
        self.seen: list[int] = []
        self.spike_at: int | None = None

    def training_step(self, batch, index):
        x, y = batch
        if self.global_step == self.spike_at:
            self.spike_at = None
            x, y = x.repeat(64, 1), y.repeat(64, 1)
        self.seen.append(x.shape[0])
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(WideRows(), batch_size=self.batch_size)


def lightning_fit(module, folder, max_steps: int = 2, **given):
    """``module`` fitted with ``VramcalBatchSize(profiles_dir=folder/profiles, ...)`` and no profile."""
    import warnings

    from vramcal.integrations.lightning import VramcalBatchSize

    callback = VramcalBatchSize(profiles_dir=folder / "profiles", capacity_bytes=own_budget(), trials=own_trials(),
                                **given)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
                         callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer, callback


FIT_SCRIPT = """
import json, resource, sys
framework, folder, budget, spike, given = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path[:0] = sys.argv[6:]
from pathlib import Path
import test_own
test_own.own_budget = lambda: budget  # the parent's: measured again it can differ by a MiB, naming another profile
folder, given, steps = Path(folder), json.loads(given), 4 if spike == "spike" else 2
if spike == "spike":  # the profile's budget: this run's memory, as its trials'
    resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
if framework == "lightning":
    module = test_own.Wide()
    module.spike_at = 1 if spike == "spike" else None
    trainer, callback = test_own.lightning_fit(module, folder, max_steps=steps, **given)
    ran = {"steps": trainer.global_step, "seen": module.seen, "path": callback.profile_source,
           "accumulated": trainer.accumulate_grad_batches, "batch_size": callback.sizing.batch_size}
else:
    from transformers import TrainingArguments
    trainer, callback = test_own.hf_train(folder, max_steps=steps, collator=test_own.Spike(at=3 if spike == "spike"
                                          else None), **given)
    s, args = callback.run.sizing, trainer.args
    ran = {"steps": trainer.state.global_step, "path": str(callback.run.path), "seen": [s.batch_size],
           "accumulated": args.gradient_accumulation_steps, "trainer": [args.per_device_train_batch_size,
           args.gradient_accumulation_steps], "sizing": [s.batch_size, s.accumulation_steps], "report": callback.report}
    if spike != "spike":
        ran["sized"] = callback.sized(TrainingArguments(output_dir=str(folder / "out"), use_cpu=True,
                                                        report_to=[])).per_device_train_batch_size
print(json.dumps(ran))
"""


def fresh_fit(framework: str, folder, spike: bool = False, **given) -> tuple[dict, str]:
    """A fit of :class:`Wide` (``lightning``) or :class:`WideModel` (``hf``) with no profile at first, run as a user
    runs one: in a fresh Python process (this one holds what every test before imported, which the process term
    rightly counts). ``spike``: 4 steps under the profile's budget, one batch 64 times larger. Returns what it printed
    (FIT_SCRIPT) and its stderr."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", FIT_SCRIPT, framework, str(folder), str(own_budget()),
                           "spike" if spike else "", json.dumps(given), *sys.path], capture_output=True, text=True,
                          timeout=900, env=env, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_lightning_calibrates_the_module_itself_once_then_reuses_its_profile(tmp_path):
    from vramcal.profile import load_profile

    first, said = fresh_fit("lightning", tmp_path)
    profile = load_profile(first["path"])
    assert profile.verified and profile.model.factory == "vramcal.integrations.lightning:trial_step"
    params = profile.model.params
    assert params["model"] == "test_own:Wide" and params["hparams"] == {"width": 8}
    assert params["data"] == [["0", [WIDE], "torch.float32"], ["1", [1], "torch.float32"]]
    assert params["precision"] == "32-true" and params["max_grad_norm"] is None
    assert first["seen"] == [first["batch_size"]] * 2 and first["batch_size"] > 64  # rows of the sample cycled
    assert "profile saved to" in said or "batch_size" in said
    second, said = fresh_fit("lightning", tmp_path)
    assert second["path"] == first["path"] and f"from the matching profile {first['path']}" in said
    reread = load_profile(first["path"])
    assert reread.trials == profile.trials and reread.created_utc == profile.created_utc  # no trial ran
    assert [o.framework for o in reread.observations] == ["lightning", "lightning"]
    assert second["seen"] == [second["batch_size"]] * 2


class Unsaved(pl.LightningModule):
    """A module whose constructor takes what it never saves in its hparams."""

    def __init__(self, width: int) -> None:
        super().__init__()
        from user_models import MLP

        self.net, self.batch_size = MLP(WIDE, width), 1

    def training_step(self, batch, index):
        return self.net(batch[0]).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(WideRows(), batch_size=self.batch_size)


def test_lightning_refuses_in_one_line_a_module_its_trials_cannot_rebuild(tmp_path):
    from vramcal.sizing import SizingError

    class Local(Wide):
        pass

    with pytest.raises(WorkloadError, match=r"Local is defined inside a function, so vramcal's trial processes"):
        lightning_fit(Local(), tmp_path)
    with pytest.raises(WorkloadError, match=r"^VramcalBatchSize\(\) rebuilds Unsaved in its trial processes as "
                                            r"Lightning's load_from_checkpoint does, Unsaved\(\*\*hparams\), and its "
                                            r"hparams lack width: call self.save_hyperparameters\(\) in "
                                            r"Unsaved.__init__$"):
        lightning_fit(Unsaved(8), tmp_path)

    class Manual(Wide):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(SizingError, match=r"Manual steps its own optimizers: calibrate its step with a factory"):
        lightning_fit(Manual(), tmp_path)
    assert not list(tmp_path.glob("profiles/**/*.json"))  # nothing calibrated


class WideConfig(PretrainedConfig):
    model_type = "vramcal-test-wide"

    def __init__(self, width: int = 8, **kwargs) -> None:
        self.width = width
        super().__init__(**kwargs)


class WideModel(PreTrainedModel):
    """A transformers model as a user writes one: built from its config, ``forward(x, y) -> loss``."""

    config_class = WideConfig

    def __init__(self, config: WideConfig) -> None:
        super().__init__(config)
        from user_models import MLP

        self.net = MLP(WIDE, config.width)
        self.post_init()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> ModelOutput:
        return ModelOutput(loss=torch.nn.functional.mse_loss(self.net(x), y))


class Rows(WideRows):
    """Samples ``{"x": (WIDE,), "y": (1,)}``."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = super().__getitem__(index)
        return {"x": x, "y": y}


class Spike:
    """The default collator, but its ``at``-th call repeats the batch 64 times (a batch the profile did not
    predict), once."""

    def __init__(self, at: int | None = None) -> None:
        from transformers import default_data_collator

        self.collate, self.at, self.calls = default_data_collator, at, 0

    def __call__(self, rows):
        self.calls += 1
        batch = self.collate(rows)
        return {k: v.repeat(64, 1) for k, v in batch.items()} if self.calls == self.at else batch


def hf_train(folder, max_steps: int = 2, collator=None, **given):
    """A Trainer of :class:`WideModel` with ``VramcalCallback(profiles_dir=folder/profiles, ...)`` and no profile."""
    import warnings

    from transformers import Trainer, TrainingArguments

    from vramcal.integrations.hf import VramcalCallback

    callback = VramcalCallback(profiles_dir=folder / "profiles", capacity_bytes=own_budget(), trials=own_trials(),
                               **given)
    args = TrainingArguments(output_dir=str(folder / "out"), max_steps=max_steps, use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=WideModel(WideConfig()), args=args, train_dataset=Rows(), callbacks=[callback],
                      data_collator=collator or Spike())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer, callback


@pytest.mark.slow
def test_the_trainer_calibrates_its_model_itself_once_then_reuses_its_profile(tmp_path):
    from transformers import TrainingArguments

    from vramcal.integrations.hf import VramcalCallback
    from vramcal.profile import load_profile
    from vramcal.sizing import SizingError

    first, _ = fresh_fit("hf", tmp_path, effective_batch_size=600)
    profile = load_profile(first["path"])
    assert profile.verified and profile.model.factory == "vramcal.integrations.hf:trial_step"
    params = profile.model.params
    assert params["model"] == "test_own:WideModel" and params["config"]["width"] == 8 and params["dtype"] == "float32"
    assert params["optimizer"] == "torch.optim.adamw:AdamW" and params["optimizer_kwargs"]["lr"] == 5e-05
    assert params["data"] == [["x", [WIDE], "torch.float32"], ["y", [1], "torch.float32"]] and params["mixed"] is None
    batch_size, steps = first["sizing"]
    assert first["trainer"] == first["sizing"] and batch_size * steps == 600  # exactly kept
    assert first["steps"] == 2 and first["report"].startswith("vramcal: peak ") and first["sized"] == batch_size
    _, said = fresh_fit("hf", tmp_path)
    assert f"vramcal: from the matching profile {first['path']}" in said and "batch_size      1" not in said
    assert load_profile(first["path"]).trials == profile.trials  # no trial ran
    with pytest.raises(SizingError, match=r"sizes the Trainer itself when train\(\) starts: pass it in "):
        VramcalCallback().sized(TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[]))


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_an_out_of_memory_error_mid_run_is_recorded_and_the_run_goes_on_smaller(framework, tmp_path):
    """Under the profile's budget (RLIMIT_DATA, as on the host its trials ran), a batch the profile did not predict
    (64 times the batch at one step) runs out of memory: the profile records it (the size, the step, the peak, the
    prediction it broke), and the run goes on at the largest size below it that a trial ran, its samples per
    optimizer step kept by accumulation; the profile stays whole, its first run's record kept."""
    from vramcal.profile import load_profile
    from vramcal.sizing import SizeRequest, size

    fresh_fit(framework, tmp_path)  # calibrated; the run below reuses the profile
    ran, said = fresh_fit(framework, tmp_path, spike=True)
    profile = load_profile(ran["path"])
    first, failed = profile.observations  # the calibrating run's, and this run's failure (its end is said only)
    assert not first.out_of_memory and failed.out_of_memory and failed.steps < 4 and failed.peak_bytes > 0
    capped = size(profile, SizeRequest()).batch_size  # now at most the largest size below it a trial ran
    assert capped < failed.batch_size and capped in {t.batch_size for t in profile.trials}
    micro, steps = ran["seen"][-1], ran["accumulated"]  # the effective batch kept, as closely as micro-batches can
    assert ran["steps"] == 4 and micro <= capped and micro * (steps - 1) < failed.batch_size <= micro * steps
    assert f"vramcal: out of memory at batch_size {failed.batch_size} after {failed.steps} steps" in said
    assert "after an out-of-memory error: not recorded" in said and "Traceback" not in said
