"""A model the user already has, calibrated without a factory of theirs: how a trial process gets it and its data.

The Lightning and Hugging Face integrations calibrate the run's own model (a LightningModule, a transformers
model) by naming a factory of their own (``vramcal.integrations.lightning:trial_step``,
``vramcal.integrations.hf:trial_step``), whose arguments, the profile's key, are:

- the model's class, as a trial process imports it (:func:`class_path`, :func:`import_class`);
- what rebuilds it there: a LightningModule's ``hparams`` (``type(module)(**module.hparams)``, as Lightning's
  ``load_from_checkpoint`` rebuilds one), a transformers model's config (random weights, as ``from_config``);
- the framework's settings that move memory (precision, the optimizer, gradient clipping, checkpointing);
- the shapes of the run's data (:func:`data_shapes`).

A trial process rebuilds the model rather than receiving it (pickled, or cloudpickled with its class): the
weights are allocated where they are measured, a model of any size costs no copy through a pipe, and the key
is what identifies the model to its framework already. A model that cannot be rebuilt so is refused, where it
is given, in one line saying what to add (``save_hyperparameters()``; a class at a module's top level).

The trial's batches come from a sample of the run's own training data: one batch of :data:`SAMPLE_ROWS` rows as
the run's dataloader gives it (its collate function and padding), taken in the run's process and saved for the
trials by its content (:func:`save_sample`); a trial takes its rows in turn (:func:`sample_batches`). The file is an
option of the calibration (it does not change the model); the shapes are in the key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import pickle
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramcal.files import atomic_write_bytes
from vramcal.workload import WorkloadError

if TYPE_CHECKING:  # pragma: no cover
    import torch

SAMPLE_ROWS = 64  # rows of the run's data a sample holds; a trial's batch takes them in turn
_SCRIPTS: dict[str, Any] = {}  # scripts imported in this process to rebuild a class from, by file
_REBUILDING: list[str] = []  # the script being imported now


def class_path(cls: type) -> str:
    """Where a trial process imports ``cls`` from: ``module:Qualname``, or, for a class of the script Python runs
    (``__main__``), ``/absolute/path/script.py:Qualname``.

    Raises:
        WorkloadError: a class no other process can import: defined inside a function, or in a ``__main__`` with no
            file (a notebook, ``python -c``).
    """
    module, name = cls.__module__, cls.__qualname__
    if "<locals>" in name:
        raise WorkloadError(f"{name} is defined inside a function, so vramcal's trial processes cannot import it: "
                            f"define it at the top level of a module or script")
    if module not in ("__main__", "__mp_main__"):
        return f"{module}:{name}"
    file = getattr(sys.modules[module], "__file__", None)
    if not file:
        raise WorkloadError(f"{name} is defined in __main__ with no file (a notebook, python -c), so vramcal's trial "
                            f"processes cannot import it: put it in a module")
    return f"{Path(file).resolve()}:{name}"


def import_class(path: str) -> Any:
    """The class :func:`class_path` named, imported in this process. A script is imported as multiprocessing's
    spawn imports a parent's main module, under the name ``__mp_main__``, so its ``if __name__ == "__main__":`` part
    does not run (:func:`refuse_training_at_import` refuses a run started meanwhile).

    Raises:
        WorkloadError: the module or script cannot be imported, or has no such class (one line, with the reason).
    """
    where, _, name = path.rpartition(":")
    try:
        target = _SCRIPTS.get(where) or _import_script(where) if where.endswith(".py") else \
            importlib.import_module(where)
        for part in name.split("."):
            target = getattr(target, part)
    except WorkloadError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure is the user's module failing
        raise WorkloadError(f"cannot import {name} from {where} ({type(error).__name__}: {_first_line(error)}), "
                            f"which vramcal's trial processes rebuild the model from") from None
    return target


def _import_script(file: str) -> Any:
    """The script ``file`` imported once in this process as ``__mp_main__`` (:func:`import_class`)."""
    spec = importlib.util.spec_from_file_location("__mp_main__", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} is no Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    _REBUILDING.append(file)
    try:
        spec.loader.exec_module(module)
    finally:
        _REBUILDING.pop()
    _SCRIPTS[file] = module
    return module


def refuse_training_at_import() -> None:
    """Raises WorkloadError when a script being imported to rebuild a model (:func:`import_class`) starts a run at
    its top level: a trial would train (and calibrate again) instead of building one step. The integrations call it
    where a run starts."""
    if _REBUILDING:
        raise WorkloadError(f"{_REBUILDING[-1]} trains when it is imported, and vramcal's trial processes import it "
                            f"to rebuild the model: put its training under `if __name__ == '__main__':`")


def save_sample(batch: Any, folder: Path | str) -> Path:
    """A sample of a run's training data for its trials: one batch as the run's dataloader gives it (tensors in
    dicts, lists and tuples, rows along the first dimension; lists of one value per row), copied to the CPU and
    saved under ``folder`` by its content (the same sample is one file, written atomically). Returns its path.

    Raises:
        WorkloadError: the batch holds no tensor, or something else than tensors, containers and plain values.
        OSError: the folder cannot be written.
    """
    import torch  # loads torch: only where a run's data is sampled

    plain = _plain(batch)
    if _rows(plain) is None:
        raise WorkloadError(f"the run's batches hold no tensor with rows ({type(batch).__name__}): vramcal's trials "
                            f"need the tensors the training step reads")
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    path = Path(folder) / f"{hashlib.sha256(buffer.getvalue()).hexdigest()[:16]}.pt"
    if not path.exists():
        atomic_write_bytes(path, buffer.getvalue())
    return path


def _plain(value: Any) -> Any:
    """``value`` as CPU tensors, plain dicts (a ``BatchEncoding`` too), lists and tuples, and plain values: what
    ``torch.load(weights_only=True)`` reads back.

    Raises:
        WorkloadError: anything else (one line naming its type).
    """
    if hasattr(value, "detach") and hasattr(value, "shape"):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(map(_plain, value)) if type(value) is tuple else [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WorkloadError(f"the run's batches hold a {type(value).__name__}: vramcal's trials take tensors, dicts, "
                        f"lists and tuples of them, and plain values")


def _rows(value: Any) -> int | None:
    """The rows of a sample: the first dimension of its first tensor with one (None: none)."""
    if hasattr(value, "shape"):
        return int(value.shape[0]) if len(value.shape) else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((rows for rows in map(_rows, items) if rows is not None), None)


def data_shapes(batch: Any) -> list[list[Any]]:
    """What a profile knows a run's data by: each tensor of one batch as ``[its place, its shape without the batch
    dimension, its dtype]`` (``[["input_ids", [512], "torch.int64"], ...]``; places ``key``, ``0``, ``0.key``).

    Raises:
        WorkloadError: as :func:`save_sample`.
    """
    found: list[list[Any]] = []

    def walk(value: Any, place: str) -> None:
        if hasattr(value, "shape"):
            found.append([place, list(value.shape[1:]), str(value.dtype)])
        elif isinstance(value, (dict, list, tuple)):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                walk(item, f"{place}.{key}" if place else str(key))

    walk(_plain(batch), "")
    return found


def sample_batches(path: Path | str, device: torch.device) -> Callable[[int], Any]:
    """``batch(batch_size)`` over the sample :func:`save_sample` wrote: its rows taken in turn (from the first again
    when the batch is larger), on ``device``.

    Raises:
        WorkloadError: the file is missing or holds no sample.
    """
    import torch  # loads torch: only in a trial

    try:
        sample = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
        raise WorkloadError(f"cannot read the sample of the run's data {path} ({_first_line(error)}): fit again, "
                            f"which samples the data anew") from None
    rows = _rows(sample)
    if rows is None:
        raise WorkloadError(f"{path} holds no sample of a run's data: fit again, which samples the data anew")

    def take(value: Any, index: Any) -> Any:
        if isinstance(value, torch.Tensor):
            rowed = value.dim() > 0 and value.shape[0] == rows
            return (value.index_select(0, index) if rowed else value).to(device)
        if isinstance(value, dict):
            return {key: take(item, index) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            if len(value) == rows and not any(isinstance(item, (torch.Tensor, dict, list, tuple)) for item in value):
                return [value[i] for i in index.tolist()]  # one plain value per row
            return type(value)(take(item, index) for item in value)
        return value

    return lambda batch_size: take(sample, torch.arange(batch_size) % rows)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
