"""The Mamba-2 implementations vramcal runs, and the one place that imports them: ``transformers`` (its
pure-PyTorch chunked scan, imported with mamba_ssm hidden: :func:`import_transformers_mamba2`) and ``mamba_ssm``
(the authors' fused Triton/CUDA kernels, GPU only, needing the compiled ``causal_conv1d``); the dtype policies and
activation checkpointing (:func:`checkpoint_every`) both families share."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from vramcal.records import Kind
from vramcal.words import given
from vramcal.workload import KERNEL_PACKAGES, TORCH_PATH

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from vramcal.records import Device

Implementation = Literal["auto", "transformers", "mamba_ssm"]
DtypePolicy = Literal["fp32", "bf16-autocast"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "transformers", "mamba_ssm")
DTYPE_POLICIES: tuple[str, ...] = ("fp32", "bf16-autocast")
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)  # bf16 tensor cores and autocast speed: Ampere (sm_80) and later
CHECKPOINTING_FORMS = "off, block or every:K"  # what the spec's checkpointing takes (checkpoint_every)
CHECKPOINTING_OFF = "off"
MODELING = "transformers.models.mamba2.modeling_mamba2"


KEY_DEFAULTS = {"checkpointing": CHECKPOINTING_OFF}  # what a profile key without the setting means (keyed_params)


def keyed_params(params: dict[str, Any]) -> dict[str, Any]:
    """A model's parameters as its profile key holds them: settings at their :data:`KEY_DEFAULTS` left out."""
    return {k: v for k, v in params.items() if KEY_DEFAULTS.get(k, object()) != v}


def checkpoint_every(checkpointing: object, n_layers: int | None = None, layers_name: str = "n_layers") -> int:
    """How many blocks apart the blocks recomputed in the backward pass are: 0 for ``off``, 1 for ``block``, K for
    ``every:K`` (blocks 0, K, 2K, ..., as transformers' ``every_n_layers``); K at most ``n_layers`` when given
    (``layers_name`` names it). One spelling per variant (``every:1`` is ``block``): one profile key each.

    Raises:
        ValueError: one line naming the setting and what it takes.
    """
    if checkpointing == CHECKPOINTING_OFF:
        return 0
    if checkpointing == "block":
        return 1
    found = re.fullmatch(r"every:([1-9][0-9]*)", checkpointing) if isinstance(checkpointing, str) else None
    if found is None:
        raise ValueError(f"checkpointing must be {CHECKPOINTING_FORMS} (every K-th block, K a whole number), got "
                         f"{checkpointing!r}")
    every = int(found.group(1))
    if every == 1:
        raise ValueError("checkpointing every:1 is every block: write block")
    if n_layers is not None and every > n_layers:
        fits = {1: "block", 2: "every:2 or block"}.get(n_layers, f"every:2 to every:{n_layers}, or block")
        raise ValueError(f"checkpointing every:{every} is more than {layers_name} {n_layers}: use {fits}")
    return every


def checkpoint_blocks(model: torch.nn.Module, every: int) -> None:
    """Recompute every ``every``-th block of a transformers model in the backward pass (0: none), by transformers'
    own ``activation_checkpointing_enable`` (formerly ``gradient_checkpointing_enable``, ``use_reentrant=False``)
    and each ``GradientCheckpointingLayer``'s flag (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
    Cost")."""
    if not every:
        return
    from transformers.modeling_layers import GradientCheckpointingLayer  # loads torch: only when called

    settings = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=settings)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings)
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = index % every == 0


def checkpoint_model(module: torch.nn.Module, every: int) -> tuple[int, int]:
    """A user's model checkpointed as a variant's trials were (``every`` 0 changes nothing): each outermost
    transformers model inside it by :func:`checkpoint_blocks`, vramcal's mamba_ssm backbone
    (:class:`vramcal.models.regressor.net.MambaSsmBackbone`) by its stride.

    Returns:
        (recomputed, blocks): the blocks recomputed now, of the blocks found (0: none vramcal can checkpoint).
    """
    transformers_model, layer = (), ()
    if "transformers.modeling_utils" in sys.modules:  # a transformers model has loaded it: never loaded here
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer

        transformers_model, layer = PreTrainedModel, GradientCheckpointingLayer
    inside: set[int] = set()
    recomputed = blocks = 0
    for part in module.modules():
        if id(part) in inside:
            continue
        if isinstance(part, transformers_model) and (layers := [m for m in part.modules() if isinstance(m, layer)]):
            checkpoint_blocks(part, every)
            inside.update(id(m) for m in part.modules())
            blocks += len(layers)
            recomputed += sum(bool(layer.gradient_checkpointing) for layer in layers)
        elif hasattr(part, "checkpoint_stride") and hasattr(part, "mixers"):
            if every:
                part.checkpoint_stride = every
            stride, count = part.checkpoint_stride, len(part.mixers)
            blocks += count
            recomputed += len(range(0, count, stride)) if stride else 0
    return recomputed, blocks


@contextlib.contextmanager
def autocast(device_type: str, dtype_policy: str) -> Iterator[None]:
    """The dtype policy's autocast on ``device_type``: bf16 for ``bf16-autocast``, else disabled (fp32).

    It sets the state as ``torch.autocast`` does (``torch.amp.autocast_mode``) without its constructor's
    ``torch.cuda.is_bf16_supported()``, which starts a CUDA context where an estimate must not (whether the card
    runs bf16 is :func:`check_dtype`'s; a CPU trace of a card: :func:`vramcal.estimate.card.as_card`)."""
    import torch

    enabled = dtype_policy == "bf16-autocast"
    before = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    torch.set_autocast_enabled(device_type, enabled)
    torch.set_autocast_dtype(device_type, torch.bfloat16)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])


def mamba_ssm_available() -> bool:
    """True when mamba_ssm's Mamba2 module and the compiled causal_conv1d can both be imported."""
    try:
        import_mamba_ssm_mamba2()
        importlib.import_module("causal_conv1d")
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def resolve_implementation(implementation: Implementation, device_kind: str) -> str:
    """The concrete implementation on a device kind: ``auto`` is ``mamba_ssm`` on CUDA where it imports, else
    ``transformers``.

    Raises:
        ValueError: ``mamba_ssm`` asked for on the host, or asked for where it cannot be imported.
    """
    if implementation == "auto":
        return "mamba_ssm" if Kind(device_kind).cuda_kernels and mamba_ssm_available() else "transformers"
    if implementation == "mamba_ssm":
        if not Kind(device_kind).cuda_kernels:
            raise ValueError(f"the mamba_ssm implementation runs on NVIDIA GPUs only: use "
                             f"{given('implementation', 'transformers')}")
        if not mamba_ssm_available():
            raise ValueError(f"mamba_ssm is not usable here (it needs mamba-ssm and the compiled causal-conv1d): "
                             f"pip install 'vramcal[cuda]' on a GPU box, or use "
                             f"{given('implementation', 'transformers')}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    return implementation


def check_dtype(device: Device, dtype_policy: str) -> None:
    """Refuse ``bf16-autocast`` off CUDA or below compute capability 8.0 (no bf16 tensor cores); unknown passes.
    Raises: ValueError: one line naming the device, its capability and the fix."""
    if dtype_policy != "bf16-autocast":
        return
    if not device.kind.cuda_kernels:
        raise ValueError("dtype bf16-autocast is for CUDA GPUs; use --dtype fp32 on the host")
    if not device.compute_capability:
        return
    major, minor = (int(part) for part in device.compute_capability.split("."))
    if (major, minor) < BF16_MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"dtype bf16-autocast needs compute capability 8.0 or newer, and {device.name} has "
                         f"{device.compute_capability}: use --dtype fp32")


def kernel_path(implementation: str) -> str:
    """The kernel path a concrete implementation runs in training, as recorded in profiles."""
    if implementation == "mamba_ssm":
        return "mamba_ssm.Mamba2 fused mamba_split_conv1d_scan_combined (Triton + causal_conv1d CUDA)"
    return TORCH_PATH


def import_transformers_mamba2() -> types.ModuleType:
    """``transformers.models.mamba2.modeling_mamba2`` bound to its pure-PyTorch functions: imported (or reloaded)
    with ``mamba_ssm``/``causal_conv1d`` hidden, as transformers binds their kernels at import."""
    saved = {key: sys.modules[key] for key in list(sys.modules) if key.split(".")[0] in KERNEL_PACKAGES}
    for key in saved:
        del sys.modules[key]
    for key in KERNEL_PACKAGES:
        sys.modules[key] = None  # type: ignore[assignment]  # makes `import key` raise ImportError
    try:
        module = sys.modules.get(MODELING)
        if module is not None and getattr(module, "_vramcal_torch_only", False):
            return module
        module = importlib.reload(module) if module is not None else importlib.import_module(MODELING)
        module._vramcal_torch_only = True
        # transformers warns at every first call that it falls back to PyTorch: here that is the intent.
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        return module
    finally:
        for key in KERNEL_PACKAGES:
            sys.modules.pop(key, None)
        sys.modules.update(saved)


def import_transformers_kernels() -> types.ModuleType:
    """``modeling_mamba2`` with mamba_ssm's kernels bound (the ``mamba_ssm`` implementation of transformers' model),
    reloaded where :func:`import_transformers_mamba2` had hidden them (the fork server preloads it so)."""
    try:
        import_mamba_ssm_mamba2()  # the package importable even without Mamba-1's compiled extension
    except ImportError:
        pass  # transformers then binds what it can import, and detect_kernel_path records it
    module = sys.modules.get(MODELING)
    if module is None:
        module = importlib.import_module(MODELING)
    elif getattr(module, "_vramcal_torch_only", False):
        module = importlib.reload(module)
    module._vramcal_torch_only = False
    return module


def import_mamba_ssm_mamba2() -> types.ModuleType:
    """``mamba_ssm.modules.mamba2``, the package entered as a bare namespace where its ``__init__`` fails on the
    Mamba-1-only ``selective_scan_cuda`` extension (mamba-ssm 2.3.2)."""
    try:
        return importlib.import_module("mamba_ssm.modules.mamba2")
    except ImportError as error:
        if "selective_scan_cuda" not in str(error):
            raise
    spec = importlib.util.find_spec("mamba_ssm")
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr]
    sys.modules["mamba_ssm"] = package
    return importlib.import_module("mamba_ssm.modules.mamba2")
