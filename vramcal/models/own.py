"""A model the user already has (a LightningModule, a transformers model), calibrated without a factory of theirs:
its key (:func:`class_path`, :func:`data_shapes`), its rebuilding in a trial and the sample of the run's data the
trial draws from (:func:`save_sample`). Why it is rebuilt, not sent: DESIGN.md "Framework processes"."""

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
from vramcal.workload import WorkloadError, first_line

if TYPE_CHECKING:  # pragma: no cover
    import torch

SAMPLE_ROWS = 64  # rows of the run's data a sample holds; a trial's batch takes them in turn
_SCRIPTS: dict[str, Any] = {}  # scripts imported in this process to rebuild a class from, by file
_REBUILDING: list[str] = []  # the script being imported now


def class_path(cls: type) -> str:
    """Where a trial process imports ``cls`` from: ``module:Qualname``, or ``/path/script.py:Qualname`` for
    ``__main__``'s.

    Raises:
        WorkloadError: defined inside a function, or in a ``__main__`` with no file (a notebook, ``python -c``).
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
    """The class :func:`class_path` named; a script imported as ``__mp_main__``, as multiprocessing's spawn does.
    Raises: WorkloadError: the module or script cannot be imported, or has no such class."""
    where, _, name = path.rpartition(":")
    try:
        target = _SCRIPTS.get(where) or _import_script(where) if where.endswith(".py") else \
            importlib.import_module(where)
        for part in name.split("."):
            target = getattr(target, part)
    except WorkloadError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure is the user's module failing
        raise WorkloadError(f"cannot import {name} from {where} ({type(error).__name__}: {first_line(error)}), "
                            f"which vramcal's trial processes rebuild the model from") from None
    return target


def _import_script(file: str) -> Any:
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
    """Raises WorkloadError when a script imported to rebuild a model (:func:`import_class`) starts a run."""
    if _REBUILDING:
        raise WorkloadError(f"{_REBUILDING[-1]} trains when it is imported, and vramcal's trial processes import it "
                            f"to rebuild the model: put its training under `if __name__ == '__main__':`")


def save_sample(batch: Any, folder: Path | str) -> Path:
    """One batch of a run's data (tensors in dicts, lists and tuples, rows first), on the CPU, saved atomically under
    ``folder`` by its content; returns its path.

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
    """``value`` as what ``torch.load(weights_only=True)`` reads back. Raises: WorkloadError: anything else."""
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
    if hasattr(value, "shape"):
        return int(value.shape[0]) if len(value.shape) else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((rows for rows in map(_rows, items) if rows is not None), None)


def data_shapes(batch: Any) -> list[list[Any]]:
    """Each tensor of a batch as ``[place, shape without the batch dimension, dtype]``
    (``[["input_ids", [512], "torch.int64"], ...]``): what a profile knows a run's data by.

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
    """``batch(batch_size)`` over the sample :func:`save_sample` wrote, its rows taken in turn, on ``device``.
    Raises: WorkloadError: the file is missing or holds no sample."""
    import torch  # loads torch: only in a trial

    try:
        sample = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
        raise WorkloadError(f"cannot read the sample of the run's data {path} ({first_line(error)}): fit again, "
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


