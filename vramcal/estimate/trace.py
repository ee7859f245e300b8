"""The storages a step allocates and frees, followed op by op: a ``TorchDispatchMode`` of vramcal's own.

Every ATen op's new storage is an ``alloc`` (unless its schema says the output aliases an input), a weak reference's
callback on the storage its ``free``, a resized storage a new allocation and the old one's free: the technique of
torch's ``MemTracker``, which keeps no ordered events for :func:`vramcal.estimate.allocator.replay` and refuses a
second iteration. Storages are labelled by :data:`CATEGORIES` for the breakdown at the peak. Not seen:
``UntypedStorage.resize_`` called directly, sparse and nested tensors.
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


# Ops the fake mode does not implement, taken from another: a pinned host copy is a host copy either way
_HOST_COPIES = {torch.ops.aten._pin_memory.default: torch.ops.aten.clone.default}


class StorageTrace(TorchDispatchMode):
    """Follows live tensor storages; a context manager inside a ``FakeTensorMode``: ``events`` in program order,
    each key's device type (``devices``) and :data:`Category` (``labels``; unlabelled: activations)."""

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

    def _see(self, tensor: torch.Tensor, counted: bool) -> None:
        if tensor.layout is not torch.strided or tensor.is_nested:
            return  # no single storage (sparse, nested)
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
        """A resized storage: a new key allocated, then the old freed (its label carried)."""
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

    def label(self, tensors: Iterable[Any], category: Category) -> None:
        """Label the storages of ``tensors`` (tensors among other values) that have no label yet."""
        for tensor in _tensors(list(tensors)):
            key = self._keys.get(id(tensor.untyped_storage()))
            if key is not None:
                self.labels.setdefault(key, category)

    def label_live(self, category: Category) -> None:
        """Label every counted storage alive now that has no label yet."""
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
    """``(peak_bytes, breakdown by CATEGORIES)``: the most live bytes on ``device_type`` at any event from ``start``
    on (the bytes live before it counted, as a trial's peak reset after its warm-up)."""
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
