"""The step as a CUDA card runs it, traced on CPU tensors: the card's own choices, made by one mechanism.

torch's CPU build cannot make fake CUDA tensors (any op on one asks for CUDA's device guard and aborts the process),
and a CUDA build's cannot run the backward (the autograd engine asks for the device's primary context). So a trace
for a card (:func:`vramcal.estimate.step.estimate_step`, ``device_kind="cuda"``) runs the factory's step on fake CPU
tensors, and wherever torch decides by the tensor's device, :func:`as_card` makes the decision CUDA makes and records
it (:attr:`Choices.made`, printed with the estimate):

* **dropout** (``F.dropout`` in training): CUDA runs the fused ``aten::native_dropout``, whose mask is a 1-byte bool
  per element (``aten/src/ATen/native/cuda/Dropout.cu``); the CPU keeps a mask of the input's dtype
  (``at::dropout``'s ``_dropout_impl``).
* **attention** (``F.scaled_dot_product_attention``): the backend ``select_sdp_backend`` picks on the card
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash, then memory-efficient, then math), called as
  that backend's own op, so the trace keeps what it keeps for backward (flash and efficient: a logsumexp per query;
  math: the seq_len² weights).
* **optimizer**: torch gives parameters on CUDA ``foreach=True`` where the group leaves it unset
  (``torch.optim.optimizer._default_to_fused_or_foreach``); a fake parameter's type hides that, so the twin sets it.
  Its ``_foreach_*`` temporaries are then in the trace.
* **autocast**: CUDA's op lists (``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, Autocast, m)``:
  :data:`CUDA_AUTOCAST`), registered for the CPU's autocast key while the trace runs, so a CPU autocast casts as
  CUDA's would (``exp``, ``softplus``, ``layer_norm``, ``cumsum``... to fp32, ``einsum`` to bf16 or fp16), with its
  cache of the weights' casts; ``torch.autocast("cuda")`` and ``torch.is_autocast_enabled()`` (mamba_ssm reads it)
  answer as on the card. Not modelled: a GradScaler's own tensors (a scale and a found-inf flag).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from vramcal.estimate.constants import card_constants

CUDA_AUTOCAST: dict[str, tuple[str, ...]] = {  # policy -> aten ops (autocast_mode.cpp, CUDA's lists)
    "lower": ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
              "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
              "matmul", "einsum", "mm", "mv", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
              "scaled_dot_product_attention"),
    "fp32": ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
             "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
             "native_layer_norm", "group_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
             "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
             "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
             "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
             "logsumexp"),
    "fp32_set_opt_dtype": ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                           "linalg_vector_norm", "linalg_matrix_norm", "sum", "sum.dim_IntList"),
    "promote": ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "tensordot", "scatter_add"),
}
# The CPU's lists name these too, where CUDA's autocast leaves them alone: passed through (autocast_mode.cpp, CPU's)
CPU_ONLY_AUTOCAST = ("conv1d.padding", "conv2d.padding", "conv3d.padding", "cat", "stack", "index_copy",
                     "binary_cross_entropy", "grid_sampler", "polar", "quantile", "nanquantile", "stft", "trace",
                     "cross_entropy_loss", "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d")


@dataclass(frozen=True)
class Card:
    """What a trace as a card needs to know of it (the catalogue's cards carry it).

    Attributes:
        name: for people. compute_capability: (major, minor), e.g. (9, 0) for an H100 (NVIDIA's CUDA GPUs table).
        sm_count: streaming multiprocessors, which some mamba_ssm wrappers size their temporaries by.
    """

    name: str = "H100 80 GB (HBM3)"
    compute_capability: tuple[int, int] = (9, 0)
    sm_count: int = 132

    @classmethod
    def of(cls, device: Any) -> Card | None:
        """The card ``device`` is traced as (a catalogue entry or a profile's device: its ``label`` or ``name``,
        ``compute_capability`` as ``"9.0"``, ``sm_count``; an H100's traits where it says none); None for the host."""
        if getattr(device, "kind", "cuda") == "host":
            return None
        default, capability = cls(), getattr(device, "compute_capability", None)
        return cls(getattr(device, "label", None) or getattr(device, "name", default.name),
                   tuple(int(part) for part in capability.split(".")) if capability else default.compute_capability,
                   getattr(device, "sm_count", None) or default.sm_count)

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


@dataclass
class Choices:
    """The card's choices a trace made (:func:`as_card`), one line each, in the order first made; ``launched``:
    whether a fused kernel's twin ran."""

    card: Card
    made: dict[str, None] = field(default_factory=dict)
    launched: bool = False

    def add(self, line: str) -> None:
        self.made.setdefault(line, None)

    def lines(self) -> tuple[str, ...]:
        return tuple(self.made)

    def workspace_bytes(self) -> tuple[int, ...]:
        """The card's cuBLAS and cuBLASLt workspaces (:func:`vramcal.estimate.constants.card_constants`)."""
        return card_constants(self.card.compute_capability).workspace_bytes


@contextlib.contextmanager
def as_card(card: Card, optimizer: Any = None) -> Iterator[Choices]:
    """Within: dropout, attention, CUDA's autocast and (given the step's ``optimizer``) AdamW's foreach as the card
    makes them (module docstring). Yields the :class:`Choices` the step makes; torch is restored on exit.

    Dropout and attention are kernels registered for ``aten::dropout`` and ``aten::scaled_dot_product_attention`` at
    the CPU's autograd key, so they hold wherever the op runs, a checkpointed block's recomputation in the backward
    pass included (a torch-function mode does not reach it, and the recomputed tensors would differ from those
    saved)."""
    choices = Choices(card)
    library = torch.library.Library("aten", "IMPL")
    try:
        with _cuda_autocast(choices, library):
            _register(library, "dropout", functools.partial(_dropout, choices), "AutogradCPU")
            _register(library, "scaled_dot_product_attention", functools.partial(_attention, choices), "AutogradCPU")
            if optimizer is not None:
                foreach(optimizer, choices)
            yield choices
    finally:
        library._destroy()


def _register(library: torch.library.Library, name: str, kernel: Any, key: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point, for the trace
        library.impl(name, kernel, key)


def foreach(optimizer: Any, choices: Choices) -> None:
    """The optimizer's groups that leave ``foreach`` unset (and are not fused) set to foreach, as on CUDA."""
    groups = [g for g in optimizer.param_groups if "foreach" in g and g["foreach"] is None and not g.get("fused")]
    for group in groups:
        group["foreach"] = True
    if groups:
        choices.add(f"optimizer: {type(optimizer).__name__} foreach=True, torch's default for CUDA parameters "
                    f"(torch.optim.optimizer._default_to_fused_or_foreach)")


def _dropout(choices: Choices, input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as CUDA runs it (``Dropout.cpp``'s ``is_fused_kernel_acceptable``, ``_dropout_impl``)."""
    if not train or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0:
        return input * torch.zeros((), dtype=input.dtype)
    choices.add("dropout: CUDA's fused native_dropout, a 1-byte bool mask per element "
                "(aten/src/ATen/native/cuda/Dropout.cu)")
    return torch.ops.aten.native_dropout.default(input, p, True)[0]


def _attention(choices: Choices, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``aten::scaled_dot_product_attention`` as the backend :func:`sdp_backend` picks on the card, called as that
    backend's own op (so its saved tensors are the card's)."""
    backend = sdp_backend(choices.card, query, key, value, attn_mask, dropout_p, is_causal)
    choices.add(f"attention: {backend} (torch's select_sdp_backend on {choices.card.sm}, "
                f"{str(query.dtype).removeprefix('torch.')}, head_dim {query.shape[-1]})")
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention.default(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention.default(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def sdp_backend(card: Card, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                dropout_p: float, is_causal: bool) -> str:
    """``flash``, ``efficient`` or ``math``: the first backend of torch's default order whose checks pass on ``card``
    (``sdp_utils.cpp``: ``check_flash_attention_hardware_support`` sm_80 and newer, fp16/bf16, no arbitrary mask,
    equal head dims <= 256, causal only when square, head_dim in (192, 256] not trained with it on sm_86-sm_89;
    ``check_mem_efficient_hardware_support`` sm_50 and newer, head dims a multiple of 4 (fp32) or 8 (fp16, bf16)).
    Nested tensors and the cuDNN backend (after math in the default order) are not modelled."""
    major_minor, half = card.compute_capability, query.dtype in (torch.float16, torch.bfloat16)
    dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    head_dim, training = query.shape[-1], query.requires_grad or key.requires_grad or value.requires_grad
    flash = (major_minor >= (8, 0) and half and attn_mask is None and len(dims) == 1 and head_dim <= 256
             and not (is_causal and query.shape[-2] != key.shape[-2])
             and not ((8, 6) <= major_minor <= (8, 9) and training and head_dim > 192))
    if flash:
        return "flash"
    alignment = 8 if half else 4
    if major_minor >= (5, 0) and query.shape[-1] == key.shape[-1] and all(d % alignment == 0 for d in dims):
        return "efficient"
    return "math"


# ------------------------------------------------------------------------------------------------ autocast

@contextlib.contextmanager
def _cuda_autocast(choices: Choices, library: torch.library.Library) -> Iterator[None]:
    """CUDA's autocast lists on the CPU's autocast key (registered in ``library``), and torch's autocast questions
    answered as on the card (module docstring); everything restored on exit."""
    cache: dict[int, tuple[Any, torch.Tensor]] = {}
    for policy, names in CUDA_AUTOCAST.items():
        for name in names:
            _register(library, name, _autocast_kernel(policy, name, cache, choices), "AutocastCPU")
    for name in CPU_ONLY_AUTOCAST:
        _register(library, name, torch.library.fallthrough_kernel, "AutocastCPU")
    saved = {name: getattr(torch, name) for name in ("is_autocast_enabled", "get_autocast_gpu_dtype",
                                                     "get_autocast_dtype", "clear_autocast_cache")}
    original_init = torch.amp.autocast_mode.autocast.__init__

    def init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        original_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def clear() -> None:
        cache.clear()
        saved["clear_autocast_cache"]()

    torch.is_autocast_enabled = lambda device_type=None: saved["is_autocast_enabled"](_host(device_type))
    torch.get_autocast_gpu_dtype = lambda: saved["get_autocast_dtype"]("cpu")
    torch.get_autocast_dtype = lambda device_type: saved["get_autocast_dtype"](_host(device_type))
    torch.clear_autocast_cache = clear
    torch.amp.autocast_mode.autocast.__init__ = init
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch, name, value)
        torch.amp.autocast_mode.autocast.__init__ = original_init
        cache.clear()


def _host(device_type: str | None) -> str:
    return "cpu" if device_type in (None, "cuda") else device_type


def _autocast_kernel(policy: str, name: str, cache: dict[int, tuple[Any, torch.Tensor]], choices: Choices) -> Any:
    """An AutocastCPU kernel that casts ``name``'s arguments by CUDA's ``policy`` and calls it with autocast off
    (autocast_mode.cpp's ``cached_cast``: eligible are floating tensors other than float64; the lower-precision cast
    of a leaf fp32 tensor that requires grad, a weight, is kept until the autocast region ends)."""
    op_name, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, op_name), overload or "default")
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    names = [argument.name for argument in op._schema.arguments]

    def cast(value: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64
                and value.dtype != dtype):
            return value
        weight = dtype != torch.float32 and value.dtype == torch.float32 and value.requires_grad and value.is_leaf
        if not weight:
            return value.to(dtype)
        ref, casted = cache.get(id(value), (None, None))
        if ref is None or ref() is not value:
            casted = value.to(dtype)
            cache[id(value)] = (weakref.ref(value), casted)
        return casted

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            if policy == "fp32_set_opt_dtype":  # the dtype argument fp32 where unset (positional or keyword)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None and first.dtype in (torch.float16, torch.bfloat16):
                    given = dict(zip(names, args)) | kwargs
                    given["dtype"] = given.get("dtype") or torch.float32
                    return op(**given)
                return op(*args, **kwargs)
            dtype = {"lower": torch.get_autocast_dtype("cpu"), "fp32": torch.float32}.get(policy) or _widest(args)
            if policy == "lower":
                choices.add(f"autocast: CUDA's {str(dtype).removeprefix('torch.')} op lists "
                            f"(aten/src/ATen/autocast_mode.cpp)")
            return op(*tree_map(lambda a: cast(a, dtype), args), **tree_map(lambda a: cast(a, dtype), kwargs))

    return kernel


def _widest(args: tuple) -> torch.dtype:
    """The promote policy's type: the widest floating dtype among the arguments."""
    found = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return max(found, key=lambda d: torch.finfo(d).bits, default=torch.float32)

