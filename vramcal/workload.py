"""What vramcal calibrates: a training step built by a factory (``module:function``) that a trial process imports.

The factory's contract (``make_step(device, **params) -> TrainingStep``, plain JSON ``params``, where its module
must be importable, a loss of ``(model, batch)`` under DDP) is DESIGN.md "The Python API"; one step as trials and
the trainer run it is :func:`train_step`. The shipped families are :mod:`vramcal.models.registry`'s.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vramcal.arguments import mapping, of_type
from vramcal.oom import is_out_of_memory
from vramcal.records import Kind
from vramcal.words import given

if TYPE_CHECKING:  # pragma: no cover
    import torch

_FACTORY_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class WorkloadError(ValueError):
    """A factory that cannot be found, called or used; the one-line message names it and the fix.

    ``in_torch``: it raised from inside torch (where an estimate's fake tensors may be the cause), not on its own.
    """

    def __init__(self, message: str, in_torch: bool = False) -> None:
        super().__init__(message)
        self.in_torch = in_torch


@dataclass
class TrainingStep:
    """One training step of a model on a device, as a factory returns it.

    Attributes:
        model: the module being trained (already on the device).
        optimizer: its optimizer (state is allocated by the first step, as in training).
        batch: ``batch(batch_size) -> batch``: the next training batch, on the device, from training's pipeline.
        loss: ``loss(model, batch) -> scalar tensor`` through ``model`` (the module or its DDP wrapper), under any
            autocast wanted; ``loss(batch)`` is accepted for one process.
        max_grad_norm: gradient clipping by total L2 norm before the optimizer step; None = no clipping.
        val_batch: ``val_batch(batch_size) -> batch`` for the validation pass; None = ``batch``.
        data_bytes: bytes the dataset holds in host memory while training (0 for generated data).
        data_on_device: True when the dataset is held in the device's memory (it then counts there).
        kernel_path: which kernels the model runs, for the profile; None: detected (:func:`detect_kernel_path`).
        info: anything else worth recording in the profile (plain JSON values).
        shard_units: under FSDP, the submodules ``fully_shard`` wraps before the root; None: every Mamba-2 block
            (:func:`vramcal.measure.distributed.shard_units`).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], Any]
    loss: Callable[..., torch.Tensor]
    max_grad_norm: float | None = 1.0
    val_batch: Callable[[int], Any] | None = None
    data_bytes: int = 0
    data_on_device: bool = False
    kernel_path: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    shard_units: Sequence[torch.nn.Module] | None = None

    def pool_data_bytes(self, device_kind: Kind) -> int:
        """Bytes of data in the measured memory pool: all of it on the host, on a GPU only device-resident data."""
        return self.data_bytes if Kind(device_kind).holds_data or self.data_on_device else 0


@dataclass(frozen=True)
class ModelRef:
    """The profile's key: ``factory`` (``module:function``) and ``params_json``, its arguments as canonical JSON."""

    factory: str
    params_json: str = "{}"

    @classmethod
    def make(cls, factory: str, params: dict[str, Any] | None = None) -> ModelRef:
        """Raises: WorkloadError: a malformed name or non-JSON arguments; TypeError: no str, or no dict."""
        of_type("factory", factory, str, "the factory as 'module:function'")
        mapping("params", params, "the factory's arguments as a dict ({'width': 512})")
        if not cls.is_factory_name(factory):
            raise WorkloadError(f"factory={factory!r} is not module:function (e.g. mypackage.train:make_step)")
        try:
            text = json.dumps(params or {}, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise WorkloadError(f"model arguments must be plain JSON values: {error}") from None
        return cls(factory, text)

    @staticmethod
    def is_factory_name(name: str) -> bool:
        """Whether ``name`` reads as ``module:function`` (dotted names on both sides)."""
        return bool(_FACTORY_NAME.match(name))

    @property
    def params(self) -> dict[str, Any]:
        return json.loads(self.params_json)

    def replace(self, **params: Any) -> ModelRef:
        return ModelRef.make(self.factory, {**self.params, **params})

    def without(self, *names: str) -> ModelRef:
        return ModelRef.make(self.factory, {k: v for k, v in self.params.items() if k not in names})

    def key(self) -> str:
        """8 hex digits of SHA-256 over the factory and its canonical arguments."""
        return hashlib.sha256(f"{self.factory}\n{self.params_json}".encode()).hexdigest()[:8]

    def to_dict(self) -> dict[str, Any]:
        return {"factory": self.factory, "params": self.params}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRef:
        return cls.make(data["factory"], data["params"])


def load_factory(ref: ModelRef) -> Callable[..., TrainingStep]:
    """Import the factory named by ``ref``.
    Raises: WorkloadError: the module cannot be imported or has no such function."""
    module_name, _, attribute = ref.factory.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's module failing
        raise WorkloadError(f"cannot import {module_name} for {given('model', ref.factory)} "
                            f"({type(error).__name__}: {first_line(error)}): check the name and that it is "
                            f"importable: installed, on PYTHONPATH, or (vramcal probe) in the current directory"
                            ) from None
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise WorkloadError(f"{module_name} has no {attribute} for {given('model', ref.factory)}: name a function "
                                f"that returns a vramcal.TrainingStep")
    if not callable(target):
        raise WorkloadError(f"{given('model', ref.factory)} is not callable: name a function that returns a "
                            f"vramcal.TrainingStep")
    return target


def accepts(factory: Callable[..., Any], name: str) -> bool:
    """Whether ``factory`` takes a keyword argument ``name`` (directly or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def build(ref: ModelRef, device: torch.device, options: dict[str, Any] | None = None) -> TrainingStep:
    """Call the factory on ``device`` with the reference's arguments and ``options`` (data options: no model change).

    Raises:
        WorkloadError: the factory is missing, raised, or did not return a :class:`TrainingStep`.
        torch.OutOfMemoryError, MemoryError: passed through (the caller records them as out-of-memory).
    """
    factory = load_factory(ref)
    try:
        step = factory(device=device, **ref.params, **(options or {}))
    except Exception as error:
        if is_out_of_memory(error):
            raise
        raise WorkloadError(f"the factory {ref.factory} raised {type(error).__name__}: {first_line(error)}",
                            in_torch=_raised_in_torch(error)) from None
    if not isinstance(step, TrainingStep):
        raise WorkloadError(f"the factory {ref.factory} returned {type(step).__name__}, not a vramcal.TrainingStep: "
                            f"return vramcal.TrainingStep(model=..., optimizer=..., batch=..., loss=...)")
    return step


KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")
TORCH_PATH = "transformers Mamba2 torch_forward (pure PyTorch chunked scan; mamba_ssm kernels not bound)"


class KernelWitness:
    """The functions of :data:`KERNEL_PACKAGES` a ``with`` block called on this thread (``sys.setprofile``), in
    ``called``: the kernels a step ran, not those bound (transformers >= 5.25 calls bound kernels for CUDA tensors
    only: ``transformers/integrations/hub_kernels.py``)."""

    def __init__(self) -> None:
        self.called: set[str] = set()
        self._previous: Any = None

    def _see(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_globals.get("__name__", "").partition(".")[0] in KERNEL_PACKAGES:
            self.called.add(frame.f_code.co_name)

    def __enter__(self) -> KernelWitness:
        self._previous = sys.getprofile()
        sys.setprofile(self._see)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)


def kernels_bound(model: torch.nn.Module) -> bool:
    """Whether ``model``'s mixers come from a ``modeling_mamba2`` that bound mamba_ssm's kernels (not imported by
    :func:`vramcal.models.mamba2.import_transformers_mamba2`)."""
    return "mamba_ssm" in sys.modules and any(not getattr(sys.modules.get(name), "_vramcal_torch_only", False)
                                              for name in _mixer_modules(model))


def _mixer_modules(model: torch.nn.Module) -> set[str]:
    return {type(m).__module__ for m in model.modules()
            if type(m).__name__ == "Mamba2Mixer" and type(m).__module__.endswith("modeling_mamba2")}


def detect_kernel_path(model: torch.nn.Module, ran: set[str] | None = None) -> str:
    """Which Mamba-2 kernels ``model`` runs, for the profile: from its modules and, where kernels are bound
    (:func:`kernels_bound`), from what a step called (``ran``: :attr:`KernelWitness.called`; None: not witnessed)."""
    kinds = {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}
    if any(k.startswith("mamba_ssm.") and k.endswith(".Mamba2") for k in kinds):
        return "mamba_ssm.Mamba2 fused kernels (Triton + causal_conv1d CUDA)"
    if not _mixer_modules(model):
        return "no Mamba-2 module found (a user model): kernels not identified"
    if not kernels_bound(model):
        return TORCH_PATH
    if ran is None:
        return "transformers Mamba2 with mamba_ssm kernels bound (no step witnessed: which path ran is not known)"
    if ran:
        return f"transformers Mamba2 with mamba_ssm kernels bound and run ({', '.join(sorted(ran))})"
    return ("transformers Mamba2 torch_forward (pure PyTorch chunked scan; mamba_ssm kernels bound, not run: "
            "transformers sends tensors on this device to the PyTorch path)")


def first_line(error: BaseException) -> str:
    """An error's first line (200 characters at most), or its type's name when it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _raised_in_torch(error: BaseException) -> bool:
    """Whether ``error`` may come from torch: its innermost frame in torch, or a RuntimeError (torch's C++)."""
    torch = sys.modules.get("torch")
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = frame.tb_frame.f_code.co_filename if frame is not None else ""
    inside = torch is not None and where.startswith(str(torch.__file__).rpartition("/")[0] + "/")
    return inside or isinstance(error, RuntimeError)


def step_loss(step: TrainingStep, batch: Any, model: torch.nn.Module | None = None) -> torch.Tensor:
    """The step's loss on ``batch`` through ``model`` (default ``step.model``; under DDP its wrapper).
    Raises: WorkloadError: the loss takes the batch alone and ``model`` is a wrapper it would bypass."""
    model = step.model if model is None else model
    if takes_model(step.loss):
        return step.loss(model, batch)
    if model is not step.model:
        raise WorkloadError("the factory's loss takes only the batch, so under DDP it would call its own module and "
                            "bypass the gradient averaging: write it as loss(model, batch), running model(...)")
    return step.loss(batch)


def takes_model(loss: Callable[..., Any]) -> bool:
    """Whether ``loss`` takes ``(model, batch)`` (two positional parameters) rather than ``(batch)``."""
    try:
        parameters = list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def train_step(step: TrainingStep, batch: Any, model: torch.nn.Module | None = None) -> torch.Tensor:
    """One optimizer step on ``batch`` through ``model`` (:func:`step_loss`); returns the loss, detached."""
    loss = step_loss(step, batch, model)
    loss.backward()
    optimizer_step(step)
    return loss.detach()


def optimizer_step(step: TrainingStep, skip_non_finite: bool = False) -> torch.Tensor | None:
    """Clip (when ``max_grad_norm`` is set), step, and free the gradients; returns the norm before clipping (None:
    no clipping). ``skip_non_finite``: a NaN or infinite norm frees the gradients without stepping (the trainer's)."""
    import torch

    norm = None
    if step.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(step.model.parameters(), step.max_grad_norm)
        if skip_non_finite and not bool(torch.isfinite(norm)):
            step.optimizer.zero_grad(set_to_none=True)
            return norm
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)
    return norm


def validation_step(step: TrainingStep, batch_size: int, model: torch.nn.Module | None = None) -> None:
    """One validation forward pass at ``batch_size`` (:func:`step_loss`), in eval mode under ``torch.no_grad()``."""
    import torch

    batch = (step.val_batch or step.batch)(batch_size)
    step.model.eval()
    with torch.no_grad():
        step_loss(step, batch, model)
    step.model.train()

