"""What vramcal calibrates: a training step, built by a factory that a trial process imports by name.

A **factory** is any importable function ``module:function`` that builds one training step on a device::

    def make_step(device: torch.device, **params) -> vramcal.TrainingStep: ...

vramcal calls it inside each trial process (and the bundled trainer calls its own factory the same
way), so the model, optimizer and data live in the process whose memory is measured. ``params`` are
plain JSON values (numbers, strings, booleans, lists, dicts): they travel to the trial process and are
kept in the profile, which identifies the calibration by the factory's name and these arguments
(:class:`ModelRef`). A factory that takes a ``seq_len`` parameter can be calibrated over several
sequence lengths.

The factory's module must be importable in the trial processes. They start with the calling process's
``sys.path`` and working directory (multiprocessing hands both over), so a module beside the calling
script, on ``PYTHONPATH`` or installed works, and ``vramcal probe`` also looks in the current directory.
A function defined in ``__main__`` or in a notebook cannot be named: put it in a module. A trial imports
the module after its meter has pinned the device, so what the module allocates when imported counts.

One step, as a trial runs it and as the trainer runs it (:func:`train_step`)::

    loss = step.loss(model, batch)   # forward pass through ``model``; any autocast inside
    loss.backward()
    clip_grad_norm_(parameters, step.max_grad_norm)   # when set
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)

where ``model`` is ``step.model``, or, in a DDP world (several ranks), ``step.model`` wrapped in
``torch.nn.parallel.DistributedDataParallel``: the forward pass must go through the wrapper for the
gradients to be averaged over the ranks, so a loss that runs under DDP takes the model it is given. A loss
of the batch alone (``loss(batch)``, calling its own module) works in one process and is refused under DDP.
A validation pass runs the loss on ``step.val_batch(batch_size)`` under ``torch.no_grad()``.

Families shipped with vramcal are named factories: ``regressor`` (the bundled Mamba-2 regressor that
``vramcal train`` trains) and ``lm`` (a Mamba-2 causal language model from a transformers
``Mamba2Config``); :mod:`vramcal.models.registry` says what differs between them.
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
from vramcal.words import given

if TYPE_CHECKING:  # pragma: no cover
    import torch

_FACTORY_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class WorkloadError(ValueError):
    """A factory that cannot be found, called or used; the one-line message names it and the fix.

    Attributes:
        in_torch: the factory raised from inside torch (an op it called), where an estimate's fake tensors may be
            the cause; False for its own failure (not importable, an argument it takes not, its own ``raise``, no
            :class:`TrainingStep` returned), which a trial meets the same way.
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
        batch: ``batch(batch_size) -> batch``: the next training batch, on the device, from the same
            data pipeline training uses (the trial draws several, as training does).
        loss: ``loss(model, batch) -> scalar tensor``: the forward pass of ``model`` (the step's module, or
            its DDP wrapper) and the loss, under any autocast wanted; ``loss(batch)`` is accepted for one
            process (module docstring).
        max_grad_norm: gradient clipping by total L2 norm before the optimizer step; None = no clipping.
        val_batch: ``val_batch(batch_size) -> batch`` for the validation pass; None = ``batch``.
        data_bytes: bytes the dataset holds in host memory while training (0 for generated data).
        data_on_device: True when the dataset is held in the device's memory (it then counts there).
        kernel_path: which kernels the model runs, for the profile (e.g. the Mamba-2 implementation);
            None lets vramcal detect it from the model's modules.
        info: anything else worth recording in the profile (plain JSON values).
        shard_units: under FSDP, the submodules ``fully_shard`` wraps before the root, each gathered whole while
            it runs; None: every Mamba-2 block of ``model`` (:func:`vramcal.measure.distributed.shard_units`).
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

    def pool_data_bytes(self, device_kind: str) -> int:
        """Bytes of data in the measured memory pool: all of it on the host, on a GPU only device-resident data."""
        return self.data_bytes if device_kind == "host" or self.data_on_device else 0


@dataclass(frozen=True)
class ModelRef:
    """The identity of what a profile calibrated: a factory and its arguments (the profile's key).

    Attributes:
        factory: ``module:function`` (a family's is in :mod:`vramcal.models.registry`).
        params_json: the arguments as canonical JSON (sorted keys), so the record is hashable and stable.
    """

    factory: str
    params_json: str = "{}"

    @classmethod
    def make(cls, factory: str, params: dict[str, Any] | None = None) -> ModelRef:
        """Raises: WorkloadError for a malformed factory name or arguments that are not plain JSON values;
        TypeError for a factory that is no str or arguments that are no dict."""
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

    Raises:
        WorkloadError: the module cannot be imported or has no such function (one line, with the reason).
    """
    module_name, _, attribute = ref.factory.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's module failing
        raise WorkloadError(f"cannot import {module_name} for {given('model', ref.factory)} "
                            f"({type(error).__name__}: {_first_line(error)}): check the name and that it is "
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
    """Call the factory on ``device`` with the reference's arguments (and ``options``, arguments that do
    not change the model, such as the regressor's data file) and check what it returns.

    Raises:
        WorkloadError: the factory is missing, raised (its error's first line), or did not return a
            :class:`TrainingStep`.
        torch.OutOfMemoryError, MemoryError: passed through (the caller records them as out-of-memory).
    """

    factory = load_factory(ref)
    try:
        step = factory(device=device, **ref.params, **(options or {}))
    except Exception as error:
        if is_out_of_memory(error):
            raise
        raise WorkloadError(f"the factory {ref.factory} raised {type(error).__name__}: {_first_line(error)}",
                            in_torch=_raised_in_torch(error)) from None
    if not isinstance(step, TrainingStep):
        raise WorkloadError(f"the factory {ref.factory} returned {type(step).__name__}, not a vramcal.TrainingStep: "
                            f"return vramcal.TrainingStep(model=..., optimizer=..., batch=..., loss=...)")
    return step


KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")
TORCH_PATH = "transformers Mamba2 torch_forward (pure PyTorch chunked scan; mamba_ssm kernels not bound)"


class KernelWitness:
    """Which Python functions of ``mamba_ssm`` and ``causal_conv1d`` the code in a ``with`` block called, on this
    thread (``sys.setprofile``): the kernels a step ran, as opposed to the kernels its model has bound.

    transformers binds mamba_ssm's kernels into ``modeling_mamba2`` when it can import them; up to 5.24 it then
    calls them for tensors on every device, from 5.25 on only for CUDA tensors (CPU tensors take the PyTorch path,
    ``transformers/integrations/hub_kernels.py``). A model's modules therefore cannot say what ran; the step
    itself can. The forward pass, where the fused functions are entered, runs on the calling thread.

    ``called``: the functions' names, such as ``mamba_split_conv1d_scan_combined``; empty when none ran.
    """

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
    """True when ``model``'s Mamba-2 mixers come from a transformers ``modeling_mamba2`` that bound mamba_ssm's
    kernels (imported with mamba_ssm importable, not through
    :func:`vramcal.models.mamba2.import_transformers_mamba2`): only a step run under :class:`KernelWitness` can
    then say which path ran."""
    return "mamba_ssm" in sys.modules and any(not getattr(sys.modules.get(name), "_vramcal_torch_only", False)
                                              for name in _mixer_modules(model))


def _mixer_modules(model: torch.nn.Module) -> set[str]:
    """The modules (transformers' ``modeling_mamba2``, by name) that ``model``'s ``Mamba2Mixer`` layers come from."""
    return {type(m).__module__ for m in model.modules()
            if type(m).__name__ == "Mamba2Mixer" and type(m).__module__.endswith("modeling_mamba2")}


def detect_kernel_path(model: torch.nn.Module, ran: set[str] | None = None) -> str:
    """Which Mamba-2 kernels a model runs, for the profile: read from its modules and, where transformers bound
    mamba_ssm's kernels (:func:`kernels_bound`), from what a step of it called (``ran``:
    :attr:`KernelWitness.called`).

    ``mamba_ssm`` ``Mamba2`` modules run the fused Triton/CUDA kernels. transformers' ``Mamba2Mixer`` runs its
    pure-PyTorch chunked scan when vramcal imported it with mamba_ssm hidden
    (:func:`vramcal.models.mamba2.import_transformers_mamba2`) or mamba_ssm is not installed; with the kernels
    bound, it runs them when a step called them, and the PyTorch path when it did not (transformers >= 5.25 on
    CPU tensors). Bound kernels with no witnessed step (``ran`` None) are recorded as bound, not run.
    """
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _raised_in_torch(error: BaseException) -> bool:
    """Whether ``error`` may come from torch: raised in torch's own Python code (its innermost frame), or a
    ``RuntimeError`` (what torch's C++ raises, with the caller's frame innermost)."""
    torch = sys.modules.get("torch")
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = frame.tb_frame.f_code.co_filename if frame is not None else ""
    inside = torch is not None and where.startswith(str(torch.__file__).rpartition("/")[0] + "/")
    return inside or isinstance(error, RuntimeError)


# ------------------------------------------------------------------------------------------- steps

def step_loss(step: TrainingStep, batch: Any, model: torch.nn.Module | None = None) -> torch.Tensor:
    """The step's loss on ``batch``, the forward pass through ``model`` (default ``step.model``; under DDP its
    wrapper), as the module docstring says.

    Raises:
        WorkloadError: the loss takes the batch alone and ``model`` is a wrapper it would bypass.
    """
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
    """Clip (when ``max_grad_norm`` is set), step, and free the gradients.

    Args:
        skip_non_finite: when the gradient norm is NaN or infinite, free the gradients without stepping,
            so the weights stay the last good ones (the trainer then stops; trials never skip).

    Returns:
        The total gradient norm before clipping (a scalar tensor), or None without clipping.
    """
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
    """One validation forward pass at ``batch_size`` through ``model`` (:func:`step_loss`) under
    ``torch.no_grad()`` in eval mode."""
    import torch

    batch = (step.val_batch or step.batch)(batch_size)
    step.model.eval()
    with torch.no_grad():
        step_loss(step, batch, model)
    step.model.train()

