"""What a CUDA process holds beyond its step's tensors, each figure with its source: a card's constants.

* cuBLAS workspaces (``aten/src/ATen/cuda/CublasHandlePool.cpp`` at pytorch 26a39059, ``parseChosenWorkspaceSize``):
  ``:4096:8`` on sm_90, ``:4096:2:16:8`` elsewhere, plus cuBLASLt's (``CUBLASLT_WORKSPACE_SIZE``, 1024 KiB), one per
  handle; a step has two handles (the forward's thread and autograd's device thread), all in the caching allocator.
* The CUDA context, outside the allocator, with lazy loading (PyTorch's default since 1.13, pytorch PR #86509):
  :data:`CONTEXT` from unslothai/unsloth-zoo PR #1053; eager: :data:`EAGER_CONTEXT`. Kernels loaded lazily on top
  are in the bound, not here; NCCL's buffers are not added (one process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 2**20
CONTEXT = 426 * MIB  # bare CUDA context, lazy loading (unsloth-zoo PR #1053: torch 2.10.0+cu130, sm_89)
EAGER_CONTEXT = 666_632_192  # CUDA_MODULE_LOADING=EAGER (pytorch PR #86509's measurement)
HOPPER_WORKSPACE = 4096 * 8 * 1024  # ":4096:8" on sm_90
WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" elsewhere
CUBLASLT_WORKSPACE = 1024 * 1024  # CUBLASLT_WORKSPACE_SIZE's default, KiB * 1024
HANDLES = 2  # the forward's thread and the autograd engine's device thread


@dataclass(frozen=True)
class CardConstants:
    """A card's constants in bytes: the context (outside the allocator), each workspace (inside), their source."""

    context_bytes: int
    workspace_bytes: tuple[int, ...]
    source: str


def card_constants(compute_capability: tuple[int, int]) -> CardConstants:
    """A card's constants under this environment (``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE`` and
    ``CUDA_MODULE_LOADING`` as torch reads them)."""
    cublas = _configured_workspace() or (HOPPER_WORKSPACE if compute_capability == (9, 0) else WORKSPACE)
    lt_kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "").strip()
    lt = int(lt_kib) * 1024 if lt_kib.isdigit() else CUBLASLT_WORKSPACE
    eager = os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() == "EAGER"
    context = EAGER_CONTEXT if eager else CONTEXT
    source = (f"CUDA context {context / MIB:.0f} MiB ({'eager' if eager else 'lazy'} module loading, published "
              f"figures; vramcal/estimate/constants.py) + {HANDLES} cuBLAS workspaces of {cublas / MIB:g} MiB and "
              f"{HANDLES} cuBLASLt of {lt / MIB:g} MiB (PyTorch's defaults on sm_{compute_capability[0]}"
              f"{compute_capability[1]})")
    return CardConstants(context, (cublas,) * HANDLES + (lt,) * HANDLES, source)


def _configured_workspace() -> int | None:
    """``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs summed as torch does, or None."""
    import re

    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    return sum(int(size) * 1024 * int(count) for size, count in pairs) or None

