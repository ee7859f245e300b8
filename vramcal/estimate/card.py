"""The step as a CUDA card runs it, traced on CPU tensors (torch's CPU build cannot make fake CUDA tensors).

Wherever torch decides by the tensor's device, :func:`as_card` makes CUDA's decision and records it: dropout's
1-byte bool mask (``aten/src/ATen/native/cuda/Dropout.cu``), the attention backend ``select_sdp_backend`` picks
(``sdp_utils.cpp``), AdamW's ``foreach`` (``_default_to_fused_or_foreach``) and CUDA's autocast lists
(``aten/src/ATen/autocast_mode.cpp``). Not modelled: a GradScaler's own tensors.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from vramcal.estimate.constants import card_constants
from vramcal.records import Kind

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
    """What a trace as a card needs: a name, ``compute_capability`` (NVIDIA's CUDA GPUs table) and ``sm_count``
    (some mamba_ssm wrappers size temporaries by it); an H100 by default."""

    name: str = "H100 80 GB (HBM3)"
    compute_capability: tuple[int, int] = (9, 0)
    sm_count: int = 132

    @classmethod
    def of(cls, device: Any) -> Card | None:
        """The card a catalogue entry or a profile's device is traced as (an H100's traits where it has none); None
        for the host."""
        if not getattr(device, "kind", Kind.CUDA).cuda_kernels:  # a catalogue entry has no kind: a card
            return None
        default, capability = cls(), getattr(device, "compute_capability", None)
        return cls(getattr(device, "label", None) or getattr(device, "name", default.name),
                   tuple(int(part) for part in capability.split(".")) if capability else default.compute_capability,
                   getattr(device, "sm_count", None) or default.sm_count)

    def traces_as(self, other: Card, traits: Iterable[str]) -> bool:
        """Whether a trace that consulted ``traits`` (:data:`TRAITS`' names) of this card holds for ``other``."""
        return all(TRAITS[name](self) == TRAITS[name](other) for name in traits)

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


# What a trace may ask of its card, by name: a trace holds for every card that answers as its own did
TRAITS: dict[str, Callable[[Card], Any]] = {
    "workspace": lambda card: card_constants(card.compute_capability).workspace_bytes,
    "compute_capability": lambda card: card.compute_capability,
    "sm_count": lambda card: card.sm_count,
    "name": lambda card: card.name,
}


@dataclass
class Choices:
    """The card's choices a trace made, one line each; ``launched``: whether a fused kernel's twin ran;
    ``consulted``: the :data:`TRAITS` the trace asked of the card."""

    card: Card
    made: dict[str, None] = field(default_factory=dict)
    launched: bool = False
    consulted: dict[str, None] = field(default_factory=dict)

    def ask(self, trait: str) -> Any:
        """The card's ``trait`` (a :data:`TRAITS` name), noted as consulted."""
        self.consulted.setdefault(trait, None)
        return TRAITS[trait](self.card)

    def add(self, line: str) -> None:
        self.made.setdefault(line, None)

    def lines(self) -> tuple[str, ...]:
        return tuple(self.made)

    def workspace_bytes(self) -> tuple[int, ...]:
        """The card's cuBLAS and cuBLASLt workspaces (:func:`vramcal.estimate.constants.card_constants`)."""
        return self.ask("workspace")


@contextlib.contextmanager
def as_card(card: Card, optimizer: Any = None) -> Iterator[Choices]:
    """Within: the card's choices (module docstring), registered at the CPU's dispatch keys so a checkpointed block's
    recomputation makes them too; yields the :class:`Choices`; torch restored on exit."""
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
    """Groups that leave ``foreach`` unset (and are not fused) set to foreach, as on CUDA."""
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
    """SDPA as :func:`sdp_backend`'s backend, called as its own op (so its saved tensors are the card's)."""
    choices.ask("compute_capability")  # the backend is the card's
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
    """``flash``, ``efficient`` or ``math``: the first of torch's default order whose checks pass on ``card``
    (``sdp_utils.cpp``'s ``check_flash_attention_hardware_support`` and ``check_mem_efficient_hardware_support``;
    nested tensors and cuDNN not modelled)."""
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


@contextlib.contextmanager
def _cuda_autocast(choices: Choices, library: torch.library.Library) -> Iterator[None]:
    """CUDA's autocast lists on the CPU's autocast key, torch's autocast questions answered as on the card."""
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
    """An AutocastCPU kernel casting ``name``'s arguments by CUDA's ``policy`` (autocast_mode.cpp's ``cached_cast``:
    a weight's lower-precision cast kept until the region ends)."""
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
    """The promote policy's widest floating dtype."""
    found = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return max(found, key=lambda d: torch.finfo(d).bits, default=torch.float32)

