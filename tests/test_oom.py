"""Triton's and NCCL's out-of-memory messages (vramcal.oom), as each library raises them, and their near misses.

The messages are the ones the libraries build (vramcal/oom.py names the file and function of each):
Triton's driver raises a RuntimeError, torch's NCCL check a ``torch.distributed.DistBackendError`` (the real
class here: it is in every torch build, the CPU one too).
"""

from __future__ import annotations

import pytest
import torch.distributed

from vramcal.oom import OOM_MESSAGES, is_out_of_memory

# torch's C10D_NCCL_CHECK: "NCCL error in: <file>:<line>, " + ncclGetErrorWithVersion + "\n" + getNcclErrorDetailStr
NCCL_HEAD = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3699, unhandled cuda error "
             "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
             "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n")

OUT_OF_MEMORY = {
    # triton driver.c / the generated launcher: "Triton Error [CUDA]: " + cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY)
    "triton": RuntimeError("Triton Error [CUDA]: out of memory"),
    # NCCL checks.h CUDACHECK (runtime API), then torch's DistBackendError
    "nccl-runtime": torch.distributed.DistBackendError(NCCL_HEAD + "Cuda failure 'out of memory'"),
    # NCCL cudawrap.h CUCHECK (driver API, cuMem buffers)
    "nccl-driver": torch.distributed.DistBackendError(NCCL_HEAD + "Cuda failure 2 'out of memory'"),
}

NOT_OUT_OF_MEMORY = {
    "triton-illegal-address": RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    "triton-launch": RuntimeError("Triton Error [CUDA]: unspecified launch failure"),
    "nccl-unknown": torch.distributed.DistBackendError(NCCL_HEAD + "Cuda failure 999 'unknown error'"),
    "nccl-state": torch.distributed.DistBackendError(
        NCCL_HEAD + "Cuda failure 401 'the operation cannot be performed in the present state'"),
    "nccl-without-last-error": torch.distributed.DistBackendError(NCCL_HEAD.removesuffix("Last error:\n")),
    "nccl-system": torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), "
        "NCCL version 2.27.3\nncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error. \nLast error:\nsocketStartConnect: Connect to 10.0.0.2<43617> failed : Connection refused"),
}


class OutOfResources(Exception):
    """triton.runtime.errors.OutOfResources (a TritonError, not a RuntimeError), with its own __str__ (triton 3.6.0)."""

    def __init__(self, required: int, limit: int, name: str) -> None:
        self.required, self.limit, self.name = required, limit, name

    def __str__(self) -> str:
        return (f"out of resource: {self.name}, Required: {self.required}, Hardware limit: {self.limit}. "
                f"Reducing block sizes or `num_stages` may help.")


@pytest.mark.parametrize("kind", sorted(OUT_OF_MEMORY))
def test_triton_and_nccl_out_of_memory_is_recognised(kind):
    assert is_out_of_memory(OUT_OF_MEMORY[kind])


@pytest.mark.parametrize("kind", sorted(OUT_OF_MEMORY))
def test_each_kind_has_its_own_entry_with_a_source(kind):
    matching = [(fragment, source) for fragment, source in OOM_MESSAGES if fragment in str(OUT_OF_MEMORY[kind])]
    assert len(matching) == 1, matching
    assert ".h" in matching[0][1] or ".c" in matching[0][1]  # names the file it comes from


@pytest.mark.parametrize("kind", sorted(NOT_OUT_OF_MEMORY))
def test_near_misses_are_not_out_of_memory(kind):
    assert not is_out_of_memory(NOT_OUT_OF_MEMORY[kind])


def test_triton_out_of_resources_is_not_out_of_memory_whatever_its_class():
    error = OutOfResources(262144, 232448, "shared memory")
    assert not is_out_of_memory(error)
    assert not is_out_of_memory(RuntimeError(str(error)))  # not even as a RuntimeError: it says nothing of memory


def test_a_nccl_out_of_memory_raised_from_inside_a_step_is_found_in_the_chain():
    try:
        try:
            raise OUT_OF_MEMORY["nccl-driver"]
        except RuntimeError as error:
            raise ValueError("the step failed") from error
    except ValueError as chained:
        assert is_out_of_memory(chained)


def test_the_message_must_come_from_a_runtime_error():
    assert not is_out_of_memory(ValueError("Triton Error [CUDA]: out of memory"))
