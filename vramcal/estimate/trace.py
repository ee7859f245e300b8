"""The storages a step allocates and frees, followed op by op: a ``TorchDispatchMode`` of vramcal's own.

:class:`StorageTrace` sees every ATen op below autograd (forward, the backward the autograd engine runs, the
optimizer's ops) and records, in order, each tensor storage an op creates (an :class:`~vramcal.estimate.allocator.Event`
``alloc`` with the storage's bytes) and each one that dies (``free``, from a weak reference's callback on the
storage: torch keeps one Python object per storage, so the callback fires when the storage itself is freed, not
when a view of it goes). This is the technique of torch's ``torch.distributed._tools.mem_tracker.MemTracker``;
vramcal does not use ``MemTracker`` itself because it keeps running totals and per-module snapshots but not the
ordered allocations and frees that the caching allocator's model needs (:func:`vramcal.estimate.allocator.replay`),
it attributes memory through module hooks the estimate has no use for, and it refuses a second iteration of the
root module in one tracker (``reset_mod_stats`` between iterations), while a trial runs several.

Which bytes count:

* an op's output whose storage the trace has not seen counts, unless the op's schema says that output aliases an
  input (``Tensor(a)``: a view, or an in-place op, of a tensor no traced op made, such as a real tensor the fake
  mode converted: the regressor's windows, which the estimate's ``data_bytes`` covers instead, or a tensor made
  from Python values, ``torch.tensor(0.0)``, such as AdamW's step counters); such a storage is known from then on
  and never counted;
* a storage whose bytes change under an op (``resize_``, an ``out=`` argument) is a new allocation followed by the
  free of the old one, as a reallocation is. ``UntypedStorage.resize_`` called directly (not an op) is not seen,
  nor are tensors without one strided storage (sparse, nested).

Each storage is labelled for the breakdown at the peak (:data:`CATEGORIES`): parameters, gradients (the
parameters' ``.grad`` as the optimizer step starts, through torch's global optimizer hooks), optimizer states
(``optimizer.state`` after its step), persistent (everything else alive when the factory returned: buffers, data the
factory placed on the device, the pipeline's own tensors) and, for the rest, activations and temporaries.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vramcal.estimate.allocator import Event

Category = Literal["parameters", "gradients", "optimizer_states", "persistent", "activations"]
CATEGORIES: tuple[Category, ...] = ("parameters", "gradients", "optimizer_states", "persistent", "activations")


# Ops that the fake mode does not implement and whose result the trace can take from another op: a pinned copy of
# a host tensor (a data pipeline's, before a non-blocking copy to the GPU) is a host copy, outside the device's
# bytes either way (FakeTensorMode raises "NYI: aten._pin_memory.default").
_HOST_COPIES = {torch.ops.aten._pin_memory.default: torch.ops.aten.clone.default}


class StorageTrace(TorchDispatchMode):
    """Follows live tensor storages (module docstring); use as a context manager, inside a ``FakeTensorMode``.

    Attributes:
        events: allocations and frees in program order (bytes: the storage's ``nbytes()``).
        devices: each storage key's device type (``cpu``, ``cuda``).
        labels: each labelled storage key's :data:`Category` (unlabelled keys are activations and temporaries).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.devices: dict[int, str] = {}
        self.labels: dict[int, Category] = {}
        self._keys: dict[int, int] = {}  # id(storage) -> key, while the storage lives
        self._bytes: dict[int, int] = {}  # counted key -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self._moved: dict[int, int] = {}  # a reallocated storage's old key -> its new key
        self._numbers = itertools.count()
        self._hooks: list[Any] = []
        self._recording = False

    def __enter__(self) -> StorageTrace:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        self._recording = True
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._recording = False
        for handle in self._hooks:
            handle.remove()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        func = _HOST_COPIES.get(func, func)
        out = func(*args, **(kwargs or {}))
        for tensor, aliases in _outputs(func, out):
            self._see(tensor, counted=not aliases)
        return out

    # ---------------------------------------------------------------------------------------------- storages

    def _see(self, tensor: torch.Tensor, counted: bool) -> None:
        if tensor.layout is not torch.strided or tensor.is_nested:
            return  # no single storage (sparse, nested): not followed (module docstring)
        storage = tensor.untyped_storage()
        key = self._keys.get(id(storage))
        if key is None:
            key = self._track(storage, tensor.device.type)
            if counted:
                self._alloc(key, storage.nbytes())
        elif key in self._bytes and self._bytes[key] != storage.nbytes():
            self._realloc(storage, key)

    def _track(self, storage: torch.UntypedStorage, device_type: str) -> int:
        key = next(self._numbers)
        self._keys[id(storage)] = key
        self.devices[key] = device_type
        self._refs[key] = weakref.ref(storage, lambda _, key=key, address=id(storage): self._gone(key, address))
        return key

    def _alloc(self, key: int, size_bytes: int) -> None:
        self._bytes[key] = size_bytes
        self.events.append(Event("alloc", key, size_bytes))

    def _realloc(self, storage: torch.UntypedStorage, old: int) -> None:
        """A storage whose bytes changed: a new key allocated, then the old freed (the old key's label carries)."""
        new = next(self._numbers)
        self._keys[id(storage)], self.devices[new] = new, self.devices[old]
        self._refs[new] = self._refs.pop(old)  # the callback still names the old key: _gone follows the move
        self._moved[old] = new
        if old in self.labels:
            self.labels[new] = self.labels[old]
        self._alloc(new, storage.nbytes())
        self._free(old)

    def _gone(self, key: int, address: int) -> None:
        key = self._current(key)
        if self._keys.get(address) == key:
            del self._keys[address]
        self._refs.pop(key, None)
        if self._recording:
            self._free(key)

    def _free(self, key: int) -> None:
        size = self._bytes.pop(key, None)
        if size is not None:
            self.events.append(Event("free", key, size))

    def _current(self, key: int) -> int:
        while key in self._moved:
            key = self._moved[key]
        return key

    # ---------------------------------------------------------------------------------------------- labels

    def label(self, tensors: Iterable[Any], category: Category) -> None:
        """Label the storages of ``tensors`` (tensors among other values) that have no label yet."""
        for tensor in _tensors(list(tensors)):
            key = self._keys.get(id(tensor.untyped_storage()))
            if key is not None:
                self.labels.setdefault(key, category)

    def label_live(self, category: Category) -> None:
        """Label every counted storage alive now that has no label yet (``persistent``: what the factory holds)."""
        for key in self._bytes:
            self.labels.setdefault(key, category)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.label((p.grad for group in optimizer.param_groups for p in group["params"]), "gradients")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.label((value for state in optimizer.state.values() for value in state.values()), "optimizer_states")


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    return (leaf for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor))


def _outputs(func: Any, out: Any) -> Iterator[tuple[torch.Tensor, bool]]:
    """Each tensor ``func`` returned, and whether its schema says it aliases an input (``Tensor(a)``)."""
    returns = getattr(getattr(func, "_schema", None), "returns", [])
    if len(returns) > 1 and isinstance(out, (tuple, list)) and len(out) == len(returns):
        pairs = list(zip(out, returns))
    else:
        pairs = [(out, returns[0] if returns else None)]
    for value, declared in pairs:
        aliases = declared is not None and declared.alias_info is not None
        for tensor in _tensors(value):
            yield tensor, aliases


def live_peak(trace: StorageTrace, device_type: str, start: int = 0) -> tuple[int, dict[Category, int]]:
    """The most bytes of live storage on ``device_type`` at any event from ``start`` on, and what held them.

    Args:
        trace: a finished trace (its labels complete).
        device_type: ``cpu`` or ``cuda``: storages on other devices are left out.
        start: the index of the first event the peak may be at (the live bytes before it are counted; a trial
            resets its peaks after the warm-up).

    Returns:
        ``(peak_bytes, breakdown)``: the breakdown by :data:`CATEGORIES` at the peak sums to ``peak_bytes``.
    """
    held = dict.fromkeys(CATEGORIES, 0)
    best, best_held, total = -1, dict(held), 0
    for index, event in enumerate(trace.events):
        if trace.devices[event.key] == device_type:
            sign = 1 if event.kind == "alloc" else -1
            held[trace.labels.get(event.key, "activations")] += sign * event.size_bytes
            total += sign * event.size_bytes
        if index + 1 >= start and total > best:
            best, best_held = total, dict(held)
    if best < 0:  # no event from start on: the live bytes then
        best, best_held = total, held
    return best, best_held
