"""Out-of-memory errors: the one place vramcal tells them from other failures.

By type (``torch.OutOfMemoryError``, ``MemoryError``), else by a message of a plain ``RuntimeError`` (or torch's
``AcceleratorError``) from :data:`OOM_MESSAGES`, each with its source. A missed one ends a calibration early; a
false one makes the search treat a bug as a memory boundary.
"""

from __future__ import annotations

import resource
import sys

# (message fragment, source), matched case-sensitively in str(error) of a RuntimeError.
OOM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("DefaultCPUAllocator: can't allocate memory",
     "torch c10/core/impl/alloc_cpu.cpp: posix_memalign failed (host trials under RLIMIT_DATA)"),
    ("CUDA error: out of memory",
     "torch c10/cuda/CUDAException.h C10_CUDA_CHECK: cudaErrorMemoryAllocation outside the caching allocator"),
    ("CUDA driver error: out of memory",
     "torch c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK: CUDA_ERROR_OUT_OF_MEMORY (expandable_segments' cuMemCreate)"),
    ("CUBLAS_STATUS_ALLOC_FAILED", "torch ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK: cuBLAS handle or workspace"),
    ("CUDNN_STATUS_ALLOC_FAILED", "torch ATen/cudnn/Exceptions.h and cudnn_frontend (cuDNN 8 and 9)"),
    ("Triton Error [CUDA]: out of memory",
     "triton third_party/nvidia/backend/driver.c gpuAssert (cuModuleLoadData) and driver.py's launcher "
     "(cuLaunchKernelEx), triton 3.6.0: the fused path's kernels"),
    ("Cuda failure 'out of memory'",
     "NCCL src/include/checks.h CUDACHECK on a runtime call (NCCL's cudaMalloc), in torch's DistBackendError "
     "'Last error:' (torch/csrc/distributed/c10d/NCCLUtils.cpp, with ENABLE_NCCL_GET_LAST_ERROR)"),
    ("Cuda failure 2 'out of memory'",
     "NCCL src/include/cudawrap.h CUCHECK on a driver call (cuMemCreate/cuMemMap), reaching Python as above"),
)

# oneDNN's dnnl_out_of_memory as torch's ideep surfaces it (oneapi/dnnl/dnnl.hpp): out-of-memory only after an
# allocation failure (in the chain, or in a process under the host budget's RLIMIT_DATA).
ONEDNN_PRIMITIVE_MESSAGE = "could not create a primitive"

# Not out-of-memory, decided: triton's OutOfResources (shared memory or registers per block: a configuration
# error) and any other "Triton Error [CUDA]"; NCCL's other CUDA failures and a bare "ncclUnhandledCudaError";
# CUDNN_STATUS_NOT_ENOUGH_WORKSPACE (a size mismatch: torch's workspaces come from the caching allocator).


def is_out_of_memory(error: BaseException, after_failure: bool = False) -> bool:
    """True when ``error`` (or an exception it was raised from or during) is an allocation failure.

    Args:
        after_failure: this process had an allocation failure before (the trainer after a fallback): oneDNN's
            message alone then counts (:data:`ONEDNN_PRIMITIVE_MESSAGE`).
    """
    chain = _chain(error)
    if any(_is_oom_itself(e) for e in chain):
        return True
    return (isinstance(error, RuntimeError) and ONEDNN_PRIMITIVE_MESSAGE in str(error)
            and (after_failure or len(chain) > 1 and any(_is_oom_itself(e) for e in chain[1:])
                 or _under_data_limit()))


def _is_oom_itself(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a torch error exists only where torch was imported; never import it here
    if isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(fragment in str(error) for fragment, _ in OOM_MESSAGES)


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain and len(chain) < 16:
        chain.append(current)
        suppressed = current.__suppress_context__  # `raise ... from None` hides the context
        current = current.__cause__ or (None if suppressed else current.__context__)
    return chain


def _under_data_limit() -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return soft != resource.RLIM_INFINITY
