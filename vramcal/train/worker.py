"""The training process: a worker forked as the trials were (:func:`vramcal.api.worker_pool`) that opens the meter,
joins the DDP or FSDP world, builds the step as the world's trials did, resumes and runs the trainer."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from vramcal.measure.distributed import build_agreed, join, wrap
from vramcal.measure.meters import open_meter
from vramcal.measure.trial import torch_device
from vramcal.models.registry import family_of
from vramcal.sizing import SizingError, scaled_lr
from vramcal.train import checkpoint
from vramcal.train.lm_loop import text_trainer
from vramcal.train.loop import Share, Trainer
from vramcal.train.plan import COLLECTIVE_TIMEOUT_S, Plan, data_identity
from vramcal.workload import build


def train_in_worker(plan: Plan, channel: Any = None) -> dict[str, Any]:
    """The training process (module docstring). Messages: ``("line", text)`` for people; asks ``("epoch", row)``
    after each epoch, whose answer ``"stop"`` ends the run.

    Returns:
        ``{"last": the last epoch row, "step", "epochs", "peak_bytes": the largest epoch peak, "data_bytes",
        "rank_peak_bytes": each rank's largest (DDP; else None), "batch_sizes": each rank's}``.
    """

    def echo(line: str) -> None:
        if channel is None:
            print(line)
        else:
            channel.send("line", line)

    def on_epoch(row: dict[str, Any]) -> Any:
        return channel.ask("epoch", row) if channel is not None else None

    meter, group = open_meter(plan.device, plan.host_memory_limit_bytes), None
    if channel is not None:
        meter = Reported(meter, channel)
    try:
        group, share, plan = _join(plan)
        if family_of(plan.model).documents:  # the language model's trainer (vramcal.train.lm_loop)
            trainer, data_bytes = text_trainer(plan, meter, echo, on_epoch)
        else:
            step, model = _build(plan, group)
            meter.check_pinned()
            state = (checkpoint.resume_from(plan.run_dir, plan.rank, echo, partial(_check_data, plan, step))
                     if plan.resume else _check_data(plan, step))
            trainer = Trainer(plan, step, meter, echo=echo, state=state, on_epoch=on_epoch, model=model, share=share)
            data_bytes = step.pool_data_bytes(plan.device.kind)
        last = trainer.run()
    finally:
        if group is not None:
            group.close()
        meter.close()
    rows = [r for r in trainer.progress.rows if r["kind"] == "epoch" and "peak_bytes" in r]
    ranks = [max(r["rank_peak_bytes"][i] for r in rows) for i in range(len(share.batch_sizes))] if group else None
    return {"last": last, "step": trainer.progress.step, "epochs": len(rows),
            "peak_bytes": max((r["peak_bytes"] for r in rows), default=None),
            "data_bytes": data_bytes, "rank_peak_bytes": ranks,
            "batch_sizes": list(share.batch_sizes)}


class Reported:
    """The meter, each peak it reads also sent to the caller (:meth:`vramcal.measure.worker.Channel.reading`: the
    evidence a kill may need)."""

    def __init__(self, meter: Any, channel: Any) -> None:
        self._meter, self._channel = meter, channel

    def read(self) -> dict[str, Any]:
        figures = self._meter.read()
        self._channel.reading(figures["peak_bytes"])
        return figures

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)


def _join(plan: Plan) -> tuple[Any, Share, Plan]:
    """Join the plan's world, agree on every rank's batch and scale the LR to the global batch; one process: no
    group."""
    if plan.world is None:
        return None, Share((plan.step_batch_size,)), plan
    import dataclasses
    import os

    (plan.run_dir / "ranks").mkdir(exist_ok=True)
    (plan.run_dir / "ranks" / f"{plan.rank}.pid").write_text(f"{os.getpid()}\n")

    group = join(plan.world, plan.rank, "env://", COLLECTIVE_TIMEOUT_S, torch_device(plan.device))
    share = Share(tuple(group.gather(plan.batch_size)), plan.rank, group)
    n_train = int(plan.data_stats["train_windows"])
    if share.global_batch > n_train:  # every rank sees the same figures, so all stop with the same line
        group.close()
        raise SizingError(f"the global batch {share.global_batch} ({' + '.join(map(str, share.batch_sizes))} over "
                          f"{len(share.batch_sizes)} ranks) is more than the {n_train} training windows: a DDP step "
                          f"needs a full batch on every rank; use more data, a smaller --stride or --batch-size")
    c = plan.config
    return group, share, dataclasses.replace(plan, lr=scaled_lr(c.lr, share.global_batch, c.reference_batch_size,
                                                                c.lr_scaling))


def _build(plan: Plan, group: Any) -> tuple[Any, Any]:
    """The step (built on every rank, agreed) and the module its forward pass goes through (DDP's wrapper)."""

    def make():
        return build(plan.model, torch_device(plan.device), plan.factory_options())

    if group is None:
        step = make()
        return step, step.model

    step = build_agreed(group, make)
    return step, wrap(step, plan.world, torch_device(plan.device))


# what a plan's data facts must still say of the file the worker reads (its rows, split, windows, normalisation)
PLANNED = ("rows", "split_row", "stride", "train_windows", "val_windows", "feature_mean", "feature_std",
           "target_scale")
# the data file's identity (plan.data_identity): all of it between the plan and the worker; on resume its content
# only (a file copied to the machine the run resumes on keeps its content, not its modification time)
IDENTITY = {"size_bytes": "size", "mtime_ns": "modification time", "head_sha256": "first MiB's SHA-256"}
CONTENT = ("size_bytes", "head_sha256")


def _check_data(plan: Plan, step: Any, state: dict[str, Any] | None = None) -> None:
    """Refuse (DataError) data that is not what the run was planned on, or, resumed (``state``), started on."""
    from vramcal.models.regressor.bars import DataError  # loads numpy: only when called

    if state is None and (changed := _changed(plan, tuple(IDENTITY), plan.data_stats, step, "planned")):
        raise DataError(f"{plan.config.data} changed after the run was planned ({changed} now): nothing was trained "
                        f"on it; start the run again")
    if state is not None and (changed := _changed(plan, CONTENT, state["data_stats"], step, "then")):
        raise DataError(f"{plan.config.data} is not the data this run started on ({changed} now): resume with the "
                        f"same file, or start a new run")


def _changed(plan: Plan, identity: tuple[str, ...], expected: dict[str, Any], step: Any, then: str) -> str | None:
    """What differs first between the data file now and its record, as ``what: X <then>, Y``; None: nothing."""
    recorded = plan.data_stats.get("file")
    if recorded:
        found = data_identity(plan.config.data)
        for key in identity:
            if found[key] != recorded[key]:
                return f"{IDENTITY[key]}: {_said(key, recorded[key])} {then}, {_said(key, found[key])}"
    now = step.pipeline.windows.stats()
    same = lambda key: json.dumps(now.get(key)) == json.dumps(expected.get(key))  # noqa: E731 - NaN == NaN
    for key in PLANNED:
        if not same(key):
            return f"{key}: {_short(expected.get(key))} {then}, {_short(now.get(key))}"
    return None


def _said(key: str, value: Any) -> str:
    """An identity's value for people: bytes, a UTC time, a hash's first 12 digits."""
    import datetime as dt

    if key == "size_bytes":
        return f"{value} bytes"
    if key == "mtime_ns":
        return dt.datetime.fromtimestamp(value / 1e9, dt.UTC).isoformat(sep=" ", timespec="microseconds")[:26]
    return f"{value[:12]}..."


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
