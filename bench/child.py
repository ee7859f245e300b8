"""One tool, run the way a user runs it: ``python -m bench.child TOOL REQUEST.json RESULT.json``.

:mod:`bench.compare` starts this module in a fresh Python process whose whole address space is already
under ``RLIMIT_DATA = budget`` (set before ``exec``, so the limit covers the interpreter, the imports and
the tool's own bookkeeping, as it would for a user's script). Each tool writes one JSON result:
``answer`` (the batch size it returns), ``trials`` (one dict per batch size it tried: ``batch_size``,
``status`` ``ok``/``oom``, ``start_s`` seconds since the process was launched) and ``answer_s`` (seconds
from the launch to the answer, measured inside the process; the parent also measures the whole process).

Tools:

* ``vramcal``: :func:`vramcal.api.plan_calibration` then :func:`vramcal.api.run_calibration` on
  ``host_device(capacity_bytes=budget)`` with its default limit settings (reserve 0.5 GiB, margin 10 %);
  ``vramcal-anchor-margin``: the same at the anchors' own margin (reserve 0, margin 5 %, Lightning
  binsearch's default ``margin=0.05``); ``vramcal-aimed``: the default settings with ``aim=True`` (``vramcal probe
  --aim``: the step traced on fake tensors first, the growth aimed with its slope). The answer is the conservative
  batch size.
* ``lightning-binsearch`` / ``lightning-power``: ``lightning.pytorch.tuner.Tuner.scale_batch_size``
  with its defaults (``init_val=2``, ``max_trials=25``, ``steps_per_trial=3``, binsearch ``margin=0.05``).
* ``accelerate``: ``accelerate.utils.find_executable_batch_size`` (back-off x0.9) from ``start``.

The same training step for all: the anchors train the step vramcal's factory builds
(:func:`vramcal.models.regressor.training_step`: the trainer's model, AdamW, loss, clipping norm and
windows of the same bars), so every tool sizes the program ``vramcal train`` runs. The anchors' batches
come from a ``DataLoader`` over those windows (shuffled, default collate), as a Lightning or Accelerate
user would write it: ``x: (batch_size, seq_len, n_features)`` float32, ``y: (batch_size, seq_len)``.
Every search runs 3 training steps per batch size (vramcal: 1 warm-up + 2 measured + a validation pass).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

PROCESS_START = time.time()  # refined from the parent's launch time in main()
STEPS_PER_TRIAL = 3


def _step(request: dict):
    """The regressor's training step from vramcal's factory, on the CPU (a fresh model, optimizer, data)."""
    import torch

    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.workload import build

    ref = RegressorSpec.from_dict(request["spec"]).ref("transformers")
    return build(ref, torch.device("cpu"), {"data": request["data"], "stride": request["stride"]})


def _windows(step):
    """A map-style dataset over the step's training windows: item ``i`` -> ``(x: (L, F), y: (L,))``."""
    from torch.utils.data import Dataset

    pipeline = step.pipeline
    length = pipeline.windows.seq_len

    class Windows(Dataset):
        def __len__(self) -> int:
            return len(pipeline.train_starts)

        def __getitem__(self, index: int):
            start = int(pipeline.train_starts[index])
            return pipeline.features[start:start + length], pipeline.targets[start:start + length]

    return Windows()


# ------------------------------------------------------------------------------------------ vramcal

def run_vramcal(request: dict, anchor_margin: bool, aim: bool = False) -> dict[str, Any]:
    from vramcal import api
    from vramcal.calibration.limits import LimitSettings
    from vramcal.measure.device import host_device

    trials: list[dict] = []

    def on_trial(trial) -> None:
        trials.append({"batch_size": trial.batch_size, "status": trial.status, "purpose": trial.purpose,
                       "peak_bytes": trial.peak_bytes, "wall_s": trial.wall_s,
                       "end_s": time.time() - PROCESS_START})

    settings = LimitSettings(reserve_bytes=0, margin=0.05) if anchor_margin else LimitSettings()
    device = host_device(capacity_bytes=request["budget_bytes"])
    plan = api.plan_calibration("regressor", request["spec"], device=device, settings=settings,
                                options={"data": request["data"], "stride": request["stride"]},
                                out=request["profile_out"], aim=aim)
    profile = api.run_calibration(plan, on_trial=on_trial)
    limits, fit = profile.limits, profile.fit
    return {"answer": limits.conservative_batch_size if limits else None, "trials": trials,
            "settings": settings.to_dict(), "limits": limits.to_dict() if limits else None,
            "fit": None if fit is None else {"overhead_bytes": fit.overhead_bytes,
                                             "slope_bytes_per_sample": fit.slope_bytes_per_sample},
            "verification": {name: v.to_dict() for name, v in profile.verification.items()},
            "verified": profile.verified, "warnings": list(profile.warnings), "profile_path": str(plan.path)}


# ---------------------------------------------------------------------------------------- Lightning

def run_lightning(request: dict, mode: str) -> dict[str, Any]:
    import tempfile

    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader

    step = _step(request)
    trials: list[dict] = []

    class Mamba2Module(pl.LightningModule):
        """vramcal's training step as a LightningModule (clipping by the Trainer, at the step's norm)."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2  # Tuner.scale_batch_size's attribute; its init_val overrides it
            self.model = step.model

        def train_dataloader(self):
            return DataLoader(_windows(step), batch_size=self.batch_size, shuffle=True)

        def training_step(self, batch, batch_index):
            from vramcal.workload import step_loss

            return step_loss(step, batch, self.model)  # batch: x (B, L, F), y (B, L); the step's own loss

        def configure_optimizers(self):
            return step.optimizer

        def on_train_start(self) -> None:  # one call per trial of the finder
            trials.append({"batch_size": self.batch_size, "status": "oom", "start_s": time.time() - PROCESS_START})

        def on_train_end(self) -> None:  # reached only when the trial's steps all finished
            trials[-1]["status"] = "ok"

    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS_PER_TRIAL, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             gradient_clip_val=step.max_grad_norm, gradient_clip_algorithm="norm",
                             default_root_dir=root)
        answer = Tuner(trainer).scale_batch_size(Mamba2Module(), mode=mode, steps_per_trial=STEPS_PER_TRIAL)
    return {"answer": answer, "trials": trials,
            "settings": {"mode": mode, "init_val": 2, "max_trials": 25, "steps_per_trial": STEPS_PER_TRIAL,
                         "margin": 0.05 if mode == "binsearch" else None}}


# --------------------------------------------------------------------------------------- Accelerate

def run_accelerate(request: dict) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size
    from torch.utils.data import DataLoader

    from vramcal.models.regressor.step import forward

    accelerator = Accelerator(cpu=True)
    trials: list[dict] = []

    @find_executable_batch_size(starting_batch_size=request["start"])
    def trial(batch_size: int) -> int:
        # Accelerate's documented pattern: free what the last attempt prepared, build everything inside.
        trials.append({"batch_size": batch_size, "status": "oom", "start_s": time.time() - PROCESS_START})
        accelerator.free_memory()
        step = _step(request)
        loader = DataLoader(_windows(step), batch_size=batch_size, shuffle=True)
        model, optimizer, loader = accelerator.prepare(step.model, step.optimizer, loader)
        dtype = step.spec.dtype
        for _, (x, y) in zip(range(STEPS_PER_TRIAL), loader):  # x: (B, L, F), y: (B, L)
            loss = torch.nn.functional.mse_loss(forward(model, x, dtype).float(), y)  # the factory's loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), step.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trials[-1]["status"] = "ok"
        return batch_size

    answer = trial()
    accelerator.free_memory()
    return {"answer": answer, "trials": trials,
            "settings": {"starting_batch_size": request["start"], "reduce": "x0.9 (default)",
                         "steps_per_trial": STEPS_PER_TRIAL}}


TOOLS = {"vramcal": lambda r: run_vramcal(r, anchor_margin=False),
         "vramcal-anchor-margin": lambda r: run_vramcal(r, anchor_margin=True),
         "vramcal-aimed": lambda r: run_vramcal(r, anchor_margin=False, aim=True),
         "lightning-binsearch": lambda r: run_lightning(r, "binsearch"),
         "lightning-power": lambda r: run_lightning(r, "power"), "accelerate": run_accelerate}


def main(argv: list[str]) -> int:
    global PROCESS_START
    tool, request_path, result_path = argv
    with open(request_path) as handle:
        request = json.load(handle)
    PROCESS_START = request.get("launched_at", PROCESS_START)
    if not tool.startswith("vramcal") and not request.get("mkldnn", True):
        import torch

        # After an out-of-memory error inside a long-lived process, oneDNN's conv1d can fail with
        # "RuntimeError: could not create a primitive", which neither Lightning's is_oom_error nor
        # Accelerate's should_reduce_batch_size recognises, so the finder crashes instead of backing
        # off. Off in every anchor process alike (native conv1d path instead); see bench/README.md.
        torch.backends.mkldnn.enabled = False
    result = TOOLS[tool](request)
    result["answer_s"] = time.time() - PROCESS_START
    with open(result_path, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
