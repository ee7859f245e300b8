"""What a CUDA process holds beyond its step's tensors, each figure with its source: a card's constants.

* **cuBLAS workspaces** (PyTorch's defaults, ``aten/src/ATen/cuda/CublasHandlePool.cpp`` at pytorch commit
  26a39059, ``parseChosenWorkspaceSize``): ``:4096:8`` = 32 MiB on sm_90 (Hopper), ``:4096:2:16:8`` = 8 MiB + 128 KiB
  on every other architecture, one per cuBLAS handle and stream (``setWorkspaceForHandle``), allocated through the
  caching allocator (``getNewWorkspace``), so they are in its reserved bytes and never freed. A training step has two
  handles: the forward's thread and the backward's (the autograd engine runs CUDA's backward on its own device
  thread, and handles are per thread, ``DeviceThreadHandlePool``). cuBLASLt's workspace (``CUBLASLT_WORKSPACE_SIZE``,
  1024 KiB by default, ``parseCUDABlasLtWorkspaceSize``) is one more allocation per handle, not unified with cuBLAS's
  unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` (``getCUDABlasLtWorkspace``). :func:`card_constants` lists them as
  allocations, replayed through the allocator's model before the step's own.
* **The CUDA context** (outside the allocator: NVML sees it, ``torch.cuda`` does not), with lazy module loading,
  PyTorch's default since 1.13 (``CUDA_MODULE_LOADING=LAZY`` when unset, pytorch/pytorch PR #86509, which measured
  274 MiB lazy against 636 MiB eager on one tensor op): :data:`CONTEXT` is the largest bare context published for a
  current PyTorch, 426 MiB (torch 2.10.0+cu130 on an RTX 6000 Ada, sm_89, nvidia-smi after ``mem_get_info``:
  unslothai/unsloth-zoo PR #1053); 256 MiB was published for torch 2.7.1+cu128 on an RTX 3090 (invoke-ai/InvokeAI
  issue #9413). With ``CUDA_MODULE_LOADING=EAGER`` every kernel image loads at once: :data:`EAGER_CONTEXT`.
  The kernels a step loads lazily on top (cuBLAS's, cuDNN's, Triton's) are not in these figures: no published figure
  separates them, so they are in the estimate's bound, not its baseline.
* **NCCL** (a world of several processes: ``NCCL_BUFFSIZE``, 4 MiB per channel and peer by default, NCCL's
  environment variable documentation) is not added: an estimate is of one process.

A measured GPU profile of the same card replaces all of these with what its process really held
(:func:`vramcal.estimated.learned_baseline`).
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
    """A card's constants (module docstring), in bytes.

    Attributes:
        context_bytes: the CUDA context, outside the caching allocator.
        workspace_bytes: each cuBLAS and cuBLASLt workspace, allocated through the caching allocator.
        source: where they come from, for people.
    """

    context_bytes: int
    workspace_bytes: tuple[int, ...]
    source: str


def card_constants(compute_capability: tuple[int, int]) -> CardConstants:
    """The constants of a card of ``compute_capability`` under this process's environment (``CUBLAS_WORKSPACE_CONFIG``
    and ``CUBLASLT_WORKSPACE_SIZE`` as torch parses them; ``CUDA_MODULE_LOADING``)."""
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
    """``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs) as ``parseChosenWorkspaceSize`` sums it, or None."""
    import re

    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    return sum(int(size) * 1024 * int(count) for size, count in pairs) or None

