"""mamba_ssm's fused Mamba-2 path traced on fake CPU tensors: its Python wrappers as they are, its launches as twins.

The wrappers (``mamba_ssm/ops/triton/ssd_combined.py``) allocate every output and saved tensor with torch ops, so on
fake tensors they allocate what they do on the card once :func:`fused_twins` stands in for Triton's launches and
autotuners (first config, pre-hook run), causal_conv1d's extension and custom ops, the card's device properties, and
lets transformers' kernel wrappers (``integrations/hub_kernels.py``) take CPU tensors. It needs ``mamba_ssm``,
``causal_conv1d`` and ``triton`` importable (without a GPU: :data:`INSTALL`).
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
from vramcal.models.mamba2 import MODELING

INSTALL = ("MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE "
           "CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation --no-deps mamba-ssm causal-conv1d "
           "triton einops")
PACKAGES = ("mamba_ssm", "causal_conv1d", "triton", "einops")


def fused_unavailable() -> str | None:
    """Why the fused path cannot be traced here (one line with the install command), or None."""
    missing = [name for name in PACKAGES if not _installed(name)]
    if not missing:
        return None
    return (f"the fused mamba_ssm path is not estimated: {', '.join(missing)} not installed; to estimate it without a "
            f"GPU: {INSTALL}")


class _Properties:
    """What ``torch.cuda.get_device_properties`` answers in the trace: the card's, each trait read noted."""

    def __init__(self, choices: Choices) -> None:
        self._choices = choices

    def __getattr__(self, name: str) -> Any:
        ask = self._choices.ask
        answers = {"multi_processor_count": lambda: ask("sm_count"), "name": lambda: ask("name"),
                   "major": lambda: ask("compute_capability")[0], "minor": lambda: ask("compute_capability")[1],
                   "gcnArchName": lambda: ""}  # not an AMD card
        if name not in answers:
            raise AttributeError(f"the traced card's properties have no {name}")
        return answers[name]()


@contextlib.contextmanager
def fused_twins(choices: Choices) -> Iterator[None]:
    """Within: mamba_ssm's kernels as twins for ``choices.card``; torch and triton restored on exit.

    Raises:
        ImportError: triton is not installed (:func:`fused_unavailable` says so first).
    """
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    twin = _extension_twin()
    saved = (JITFunction.run, Autotuner.run, torch.cuda.get_device_properties, torch.cuda.device)

    def launch(self: Any, *args: Any, **kwargs: Any) -> None:
        choices.launched = True
        choices.add(f"fused kernels: mamba_ssm's wrappers with Triton launches and causal_conv1d's extension as "
                    f"twins, the card's SM count ({choices.card.sm_count}) where a wrapper reads it")

    JITFunction.run = launch
    Autotuner.run = _first_config
    torch.cuda.get_device_properties = lambda device=None: _Properties(choices)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    hub = importlib.import_module("transformers.integrations.hub_kernels")
    devices = dict(hub._PACKAGE_SUPPORTED_DEVICES)
    hub._PACKAGE_SUPPORTED_DEVICES.update({name: (*devices.get(name, ()), "cpu") for name in PACKAGES[:2]})
    sys.modules.pop(MODELING, None)
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run, torch.cuda.get_device_properties, torch.cuda.device = saved
        hub._PACKAGE_SUPPORTED_DEVICES.update(devices)
        sys.modules.pop(MODELING, None)
        if twin:  # nothing imported with the twin outlives the trace: mamba_ssm_available() answers for real
            _drop("causal_conv1d_cuda", "causal_conv1d", "mamba_ssm")


def _first_config(self: Any, *args: Any, **kwargs: Any) -> None:
    """``Autotuner.run`` without benchmarking: its first config, its pre-hook, the launch's twin."""
    config = self.configs[0]
    self.best_config = config
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})
    self.fn.run(*args, **kwargs, **config.all_kwargs())  # the launch's twin


def _extension_twin() -> bool:
    """causal_conv1d's extension twinned where not built (True: it was), and its custom ops faked."""
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
    """Whether ``name`` is imported (even without a spec) or importable."""
    return sys.modules.get(name) is not None or importlib.util.find_spec(name) is not None


def _drop(*packages: str) -> None:
    for key in [k for k in sys.modules if k.split(".")[0] in packages]:
        del sys.modules[key]
