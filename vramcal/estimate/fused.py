"""mamba_ssm's fused Mamba-2 path traced on fake CPU tensors: its Python wrappers as they are, its launches as twins.

A card with ``mamba_ssm`` installed runs ``mamba_split_conv1d_scan_combined``
(``mamba_ssm/ops/triton/ssd_combined.py``), which keeps for backward only the block's input projection, the scan's
output before the gated norm and the norm's rstd (``ctx.save_for_backward``) and recomputes the rest; transformers'
PyTorch chunked scan keeps every intermediate, several times more bytes per sample. mamba_ssm's wrappers allocate
every output, saved tensor and workspace with torch ops before a kernel writes into it, so on fake tensors they
allocate what they allocate on the card, once their kernels are twins of what they launch (:func:`fused_twins`):

* Triton launches (``JITFunction.run``) do nothing; an autotuner (``Autotuner.run``) takes its first config as the one
  chosen (its ``best_config``, which some wrappers read to size a reduction) and runs its pre-hook (in-place zeroing),
  without benchmarking;
* causal_conv1d's CUDA extension (``causal_conv1d_cuda``: ``causal_conv1d_fwd``/``_bwd``/``_update`` write into the
  outputs its Python wrappers allocated) is a module of no-ops where the extension is not built, and its custom ops
  (``DaoAILab::_causal_conv1d_*_cpp``, which mutate their outputs and return nothing) get fake implementations that do
  nothing;
* transformers' wrappers of these kernels send CPU tensors to its PyTorch path (5.25:
  ``integrations/hub_kernels.py``, ``_PACKAGE_SUPPORTED_DEVICES``, bound when ``modeling_mamba2`` is imported): CPU is
  listed too while the twins hold, and that module is imported afresh within them and dropped after, so the ``lm``
  family's ``mamba_ssm`` path (transformers' Mamba2 with the kernels bound) is traced on the kernels;
* ``torch.cuda.get_device_properties`` answers with the card's SM count and compute capability (the layer norms'
  backward and ``_chunk_state_bwd_db`` size their temporaries by the SM count), and ``torch.cuda.device(index)`` is
  a no-op for a CPU tensor's index.

It needs ``mamba_ssm``, ``causal_conv1d`` and ``triton`` importable: on a host without a GPU, install the first two
without their CUDA builds (:data:`INSTALL`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

from vramcal.estimate.card import Choices

INSTALL = ("MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE "
           "CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation --no-deps mamba-ssm causal-conv1d "
           "triton einops")
PACKAGES = ("mamba_ssm", "causal_conv1d", "triton", "einops")
TRANSFORMERS_MAMBA2 = "transformers.models.mamba2.modeling_mamba2"


def fused_unavailable() -> str | None:
    """Why the fused path cannot be traced here (one line with the install command), or None."""
    missing = [name for name in PACKAGES if not _installed(name)]
    if not missing:
        return None
    return (f"the fused mamba_ssm path is not estimated: {', '.join(missing)} not installed; to estimate it without a "
            f"GPU: {INSTALL}")


class _Properties:
    """What ``torch.cuda.get_device_properties`` answers in the trace: the card's
    (:class:`~vramcal.estimate.card.Card`)."""

    def __init__(self, card: Any) -> None:
        self.name, self.multi_processor_count = card.name, card.sm_count
        self.major, self.minor = card.compute_capability
        self.gcnArchName = ""


@contextlib.contextmanager
def fused_twins(choices: Choices) -> Iterator[None]:
    """Within: mamba_ssm's kernels as twins (module docstring), for ``choices.card``; torch and triton restored on
    exit. Raises: ImportError: triton is not installed (:func:`fused_unavailable` says so first)."""
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    twin = _extension_twin()
    saved = (JITFunction.run, Autotuner.run, torch.cuda.get_device_properties, torch.cuda.device)

    def launch(self: Any, *args: Any, **kwargs: Any) -> None:
        choices.launched = True
        choices.add(f"fused kernels: mamba_ssm's wrappers with Triton launches and causal_conv1d's extension as "
                    f"twins, {choices.card.sm_count} SMs ({choices.card.name}) where a wrapper reads the card")

    JITFunction.run = launch
    Autotuner.run = _first_config
    torch.cuda.get_device_properties = lambda device=None: _Properties(choices.card)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    hub = importlib.import_module("transformers.integrations.hub_kernels")
    devices = dict(hub._PACKAGE_SUPPORTED_DEVICES)
    hub._PACKAGE_SUPPORTED_DEVICES.update({name: (*devices.get(name, ()), "cpu") for name in PACKAGES[:2]})
    sys.modules.pop(TRANSFORMERS_MAMBA2, None)
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run, torch.cuda.get_device_properties, torch.cuda.device = saved
        hub._PACKAGE_SUPPORTED_DEVICES.update(devices)
        sys.modules.pop(TRANSFORMERS_MAMBA2, None)
        if twin:  # nothing imported with the twin outlives the trace: mamba_ssm_available() answers for real
            _drop("causal_conv1d_cuda", "causal_conv1d", "mamba_ssm")


def _first_config(self: Any, *args: Any, **kwargs: Any) -> None:
    """``Autotuner.run`` without benchmarking: its first config chosen, its pre-hook run, the launch's twin called."""
    config = self.configs[0]
    self.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})
    self.fn.run(*args, **kwargs, **config.all_kwargs())  # the launch's twin


def _extension_twin() -> bool:
    """causal_conv1d's extension where it is not built (True: the twin was put in), and fake implementations of its
    custom ops."""
    needed = not _installed("causal_conv1d_cuda")
    if needed:
        twin = types.ModuleType("causal_conv1d_cuda")
        twin.causal_conv1d_fwd = twin.causal_conv1d_bwd = twin.causal_conv1d_update = lambda *a, **k: None
        twin.__doc__ = "vramcal's twin of causal_conv1d's CUDA extension: its functions write into given outputs"
        sys.modules["causal_conv1d_cuda"] = twin
        _drop("causal_conv1d", "mamba_ssm")  # imported without the extension: again, with the twin
    functions = importlib.import_module("causal_conv1d.cpp_functions")
    for name in ("_causal_conv1d_fwd_cpp", "_causal_conv1d_bwd_cpp", "_causal_conv1d_update_cpp"):
        op = getattr(functions, name)
        if getattr(op, "_abstract_fn", None) is None:
            op.register_fake(lambda *args, **kwargs: None)
    return needed


def _installed(name: str) -> bool:
    """Whether ``name`` is imported or importable (a module entered without a spec, as vramcal enters mamba_ssm
    without its Mamba-1 extension, counts)."""
    return sys.modules.get(name) is not None or importlib.util.find_spec(name) is not None


def _drop(*packages: str) -> None:
    for key in [k for k in sys.modules if k.split(".")[0] in packages]:
        del sys.modules[key]
