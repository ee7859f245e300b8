"""Out-of-memory errors: the one place vramcal tells them from other failures.

By type first: ``torch.OutOfMemoryError`` (the CUDA caching allocator) and ``MemoryError`` (Python).
Some allocation failures reach Python as a plain ``RuntimeError`` (or torch's ``AcceleratorError``, a
subclass) whose only mark is the message; those are the patterns below, each with where it comes from.
A trial that hits one is a batch size that does not fit, so classifying one as an ordinary error would
end a calibration early, and the reverse would make a search treat a bug as a memory boundary.
"""

from __future__ import annotations

import resource
import sys

# (message fragment, source). Matched case-sensitively against str(error) of a RuntimeError.
OOM_MESSAGES: tuple[tuple[str, str], ...] = (
    ("DefaultCPUAllocator: can't allocate memory",
     "torch c10/core/impl/alloc_cpu.cpp: the CPU allocator's failed posix_memalign (host trials under RLIMIT_DATA)"),
    ("CUDA error: out of memory",
     "torch c10/cuda/CUDAException.h C10_CUDA_CHECK: cudaErrorMemoryAllocation outside the caching allocator "
     "(context creation, a kernel launch that needs local memory, a library's own cudaMalloc)"),
    ("CUDA driver error: out of memory",
     "torch c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK: CUDA_ERROR_OUT_OF_MEMORY from the driver API "
     "(cuMemCreate/cuMemMap of expandable_segments)"),
    ("CUBLAS_STATUS_ALLOC_FAILED",
     "torch ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK: cuBLAS could not allocate its handle or workspace"),
    ("CUDNN_STATUS_ALLOC_FAILED",
     "torch ATen/cudnn/Exceptions.h and cudnn_frontend: cuDNN could not allocate (cuDNN 8 and 9 status name)"),
    ("Triton Error [CUDA]: out of memory",
     "triton third_party/nvidia/backend/driver.c gpuAssert (loadBinary's cuModuleLoadData, the kernel's module) and "
     "the launcher that third_party/nvidia/backend/driver.py generates (its gpuAssert around cuLaunchKernelEx): "
     "'Triton Error [CUDA]: ' + cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY), raised as a RuntimeError (read in the "
     "triton 3.6.0 wheel, the H200 image's; the fused path's kernels)"),
    ("Cuda failure 'out of memory'",
     "NCCL src/include/checks.h CUDACHECK: WARN(\"Cuda failure '%s'\", cudaGetErrorString(err)) on a CUDA runtime "
     "call (NCCL's own cudaMalloc of its buffers) failing with cudaErrorMemoryAllocation. torch's C10D_NCCL_CHECK "
     "(torch/csrc/distributed/c10d/NCCLUtils.hpp) raises DistBackendError (a RuntimeError) whose message "
     "getNcclErrorDetailStr (NCCLUtils.cpp) ends with 'ncclUnhandledCudaError: Call to CUDA function failed.' and "
     "'Last error:' + ncclGetLastError(), the WARN text (where torch is built with ENABLE_NCCL_GET_LAST_ERROR)"),
    ("Cuda failure 2 'out of memory'",
     "NCCL src/include/cudawrap.h CUCHECK: WARN(\"Cuda failure %d '%s'\", err, errStr) on a CUDA driver call "
     "(cuMemCreate/cuMemMap of NCCL's cuMem buffers) failing with CUDA_ERROR_OUT_OF_MEMORY = 2; reaches Python as "
     "the line above does"),
)

# oneDNN (the CPU kernels) reports a failed scratchpad allocation as dnnl_out_of_memory, which torch's
# ideep layer surfaces only as this (oneapi/dnnl/dnnl.hpp). It is out-of-memory when it follows an
# allocation failure: one in the exception's chain, or this process running under the host budget
# (RLIMIT_DATA), where a refused malloc is what makes primitive creation fail.
ONEDNN_PRIMITIVE_MESSAGE = "could not create a primitive"

# Not out-of-memory, decided:
# - triton.runtime.errors.OutOfResources ("out of resource: shared memory, Required: ..., Hardware
#   limit: ..."): a kernel configuration needs more shared memory or registers per block than an SM
#   has. It does not depend on free device memory; it is a kernel/configuration error (and a TritonError,
#   not a RuntimeError). Nor is any other "Triton Error [CUDA]: ..." (an illegal address, a launch failure).
# - NCCL's other CUDA failures ("Cuda failure 999 'unknown error'", "Cuda failure 401 'the operation cannot be
#   performed in the present state'"), and a bare "ncclUnhandledCudaError" without NCCL's last error (a torch
#   built without ENABLE_NCCL_GET_LAST_ERROR): nothing in them says the card was full.
# - CUDNN_STATUS_NOT_ENOUGH_WORKSPACE: the workspace handed to cuDNN is smaller than the algorithm
#   asked for (torch allocates workspaces through the caching allocator, so exhaustion there is a
#   torch.OutOfMemoryError); it is a size mismatch, not exhaustion.


def is_out_of_memory(error: BaseException, after_failure: bool = False) -> bool:
    """True when ``error`` (or an exception it was raised from or during) is an allocation failure.

    See :data:`OOM_MESSAGES` and :data:`ONEDNN_PRIMITIVE_MESSAGE` for the message-only kinds.

    Args:
        after_failure: this process already had an allocation failure (the trainer after a fallback): a
            process whose memory an earlier failure left fragmented or held fails the next oneDNN
            scratchpad allocation with only oneDNN's message, with no allocation error left in its chain
            (seen under ``prlimit --data``, issue 10).
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
