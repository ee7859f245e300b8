"""One tool, run the way a user runs it: ``python -m bench.child TOOL REQUEST.json RESULT.json``.

:mod:`bench.compare` starts this module in a fresh Python process whose whole address space is already
under ``RLIMIT_DATA = budget`` (set before ``exec``, so the limit covers the interpreter, the imports and
the tool's own bookkeeping, as it would for a user's script). Each tool writes one JSON result:
``answer`` (the batch size it returns), ``trials`` (one dict per batch size it tried: ``batch_size``,
``status`` ``ok``/``oom``, ``start_s`` seconds since the process started) and ``answer_s`` (seconds from
the process start to the answer, measured inside the process; the parent also measures the process's
whole wall time).

Tools:

* ``vramcal``: :func:`vramcal.calibrate.probe.calibrate` on ``host_device(capacity_bytes=budget)``.
* ``lightning-binsearch`` / ``lightning-power``: ``lightning.pytorch.tuner.Tuner.scale_batch_size``
  with its defaults (``init_val=2``, ``max_trials=25``, ``steps_per_trial=3``, binsearch ``margin=0.05``)
  on the same model in a LightningModule.
* ``accelerate``: ``accelerate.utils.find_executable_batch_size`` (back-off x0.9) from ``start``.
* ``survive``: ``steps`` real :func:`vramcal.train.step.train_step` calls at ``batch_size``, a fresh
  random batch per step as a data loader would give; records the status and the peak RSS (VmHWM).

Every search runs 3 training steps per batch size (vramcal: 1 warm-up + 2 measured), with AdamW
(lr 1e-4, weight decay 0.01), gradient clipping at norm 1.0, and mean-squared error on
``x: (batch_size, seq_len, n_features)`` float32 -> ``(batch_size, seq_len)``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from typing import Any

PROCESS_START = time.time()  # refined from the parent's launch time in main()
STEPS_PER_TRIAL = 3


def _spec(request: dict):
    from vramcal.models.regressor import ModelSpec

    return ModelSpec.from_dict(request["spec"])


def _random_bars(spec, length: int = 2**24):
    """A map-style dataset of random samples: item ``i`` -> (x: (seq_len, n_features), y: (seq_len,))."""
    import torch
    from torch.utils.data import Dataset

    class RandomBars(Dataset):
        def __len__(self) -> int:
            return length  # far above any batch size, so Lightning never caps at the dataset length

        def __getitem__(self, index: int):
            return torch.randn(spec.seq_len, spec.n_features), torch.randn(spec.seq_len)

    return RandomBars()


# ------------------------------------------------------------------------------------------ vramcal

def run_vramcal(request: dict) -> dict[str, Any]:
    from vramcal.calibrate.limits import LimitSettings
    from vramcal.calibrate.probe import calibrate
    from vramcal.measure.device import host_device

    trials: list[dict] = []
    trial_start = [time.time()]

    def on_trial(trial) -> None:
        trials.append({"batch_size": trial.batch_size, "status": trial.status, "purpose": trial.purpose,
                       "peak_bytes": trial.peak_bytes, "wall_s": trial.wall_s,
                       "start_s": trial_start[0] - PROCESS_START})
        trial_start[0] = time.time()

    profile = calibrate(host_device(capacity_bytes=request["budget_bytes"]), _spec(request), "transformers",
                        LimitSettings(), on_trial=on_trial)
    limits, fit = profile.limits, profile.fit
    return {"answer": limits.conservative_batch_size, "trials": trials,
            "limits": limits.to_dict(), "fit": {"overhead_bytes": fit.overhead_bytes,
                                                "slope_bytes_per_sample": fit.slope_bytes_per_sample},
            "verification": {name: dataclasses.asdict(v) for name, v in profile.verification.items()},
            "warnings": list(profile.warnings)}


# ---------------------------------------------------------------------------------------- Lightning

def run_lightning(request: dict, mode: str) -> dict[str, Any]:
    import tempfile

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader

    from vramcal.models.regressor import build_model
    from vramcal.train.step import forward, make_optimizer

    spec = _spec(request)
    trials: list[dict] = []

    class Mamba2Module(pl.LightningModule):
        """The vramcal model, optimizer and loss as a LightningModule (clipping by the Trainer)."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2  # Tuner.scale_batch_size's attribute; its init_val overrides it
            self.model = build_model(spec, "transformers")

        def train_dataloader(self):
            return DataLoader(_random_bars(spec), batch_size=self.batch_size)

        def training_step(self, batch, batch_index):
            x, y = batch  # (B, L, F), (B, L)
            return torch.nn.functional.mse_loss(forward(self.model, x, spec.dtype, "cpu").float(), y)

        def configure_optimizers(self):
            return make_optimizer(self.model, lr=1e-4)

        def on_train_start(self) -> None:  # one call per trial of the finder
            trials.append({"batch_size": self.batch_size, "status": "oom", "start_s": time.time() - PROCESS_START})

        def on_train_end(self) -> None:  # reached only when the trial's steps all finished
            trials[-1]["status"] = "ok"

    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS_PER_TRIAL, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             gradient_clip_val=1.0, gradient_clip_algorithm="norm", default_root_dir=root)
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

    from vramcal.models.regressor import build_model
    from vramcal.train.step import forward, make_optimizer

    spec = _spec(request)
    accelerator = Accelerator(cpu=True)
    trials: list[dict] = []

    @find_executable_batch_size(starting_batch_size=request["start"])
    def trial(batch_size: int) -> int:
        # Accelerate's documented pattern: free what the last attempt prepared, build everything inside.
        trials.append({"batch_size": batch_size, "status": "oom", "start_s": time.time() - PROCESS_START})
        accelerator.free_memory()
        model = build_model(spec, "transformers")
        optimizer = make_optimizer(model, lr=1e-4)
        loader = DataLoader(_random_bars(spec), batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for _, (x, y) in zip(range(STEPS_PER_TRIAL), loader):  # x: (B, L, F), y: (B, L)
            loss = torch.nn.functional.mse_loss(forward(model, x, spec.dtype, "cpu").float(), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trials[-1]["status"] = "ok"
        return batch_size

    answer = trial()
    accelerator.free_memory()
    return {"answer": answer, "trials": trials,
            "settings": {"starting_batch_size": request["start"], "reduce": "x0.9 (default)",
                         "steps_per_trial": STEPS_PER_TRIAL}}


# ------------------------------------------------------------------------------------------ survive

def run_survive(request: dict) -> dict[str, Any]:
    """``steps`` training steps at ``batch_size``; status ``ok`` or ``oom`` (classified by vramcal)."""
    import torch

    from vramcal.measure.meters import is_out_of_memory, read_status_bytes
    from vramcal.models.regressor import build_model
    from vramcal.train.step import make_optimizer, train_step

    spec, batch_size = _spec(request), request["batch_size"]
    torch.manual_seed(0)
    done, status, error = 0, "ok", None
    try:
        model = build_model(spec, "transformers")
        optimizer = make_optimizer(model, lr=1e-4)
        for _ in range(request["steps"]):
            x = torch.randn(batch_size, spec.seq_len, spec.n_features)  # (B, L, F)
            y = torch.randn(batch_size, spec.seq_len)  # (B, L)
            train_step(model, optimizer, x, y, spec.dtype, "cpu")
            done += 1
    except Exception as caught:  # noqa: BLE001 - the outcome is the measurement
        status = "oom" if is_out_of_memory(caught) else "error"
        error = "".join(traceback.format_exception(caught)[-2:])[-800:]
    return {"answer": batch_size, "status": status, "steps_done": done, "error": error,
            "rss_peak_bytes": read_status_bytes("VmHWM"), "trials": []}


TOOLS = {"vramcal": run_vramcal, "lightning-binsearch": lambda r: run_lightning(r, "binsearch"),
         "lightning-power": lambda r: run_lightning(r, "power"), "accelerate": run_accelerate,
         "survive": run_survive}


def main(argv: list[str]) -> int:
    global PROCESS_START
    tool, request_path, result_path = argv
    with open(request_path) as handle:
        request = json.load(handle)
    PROCESS_START = request.get("launched_at", PROCESS_START)
    if tool != "vramcal" and not request.get("mkldnn", True):
        import torch

        # After an out-of-memory error inside a long-lived process, oneDNN's conv1d can fail with
        # "RuntimeError: could not create a primitive", which neither Lightning's is_oom_error nor
        # Accelerate's should_reduce_batch_size (nor vramcal) recognises, so the finder crashes instead
        # of backing off. Off in every anchor and survival process alike (native conv1d path instead).
        torch.backends.mkldnn.enabled = False
    result = TOOLS[tool](request)
    result["answer_s"] = time.time() - PROCESS_START
    with open(result_path, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
