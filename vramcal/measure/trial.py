"""One trial: real training steps of the real model at one batch size, in a process of its own.

A trial is a fresh process forked from a fork server that has already imported torch and the
transformers Mamba-2 module (``multiprocessing`` ``forkserver`` with a preload), so a trial's start-up
costs a fork, not the seconds of importing torch and transformers, and no trial inherits allocator
state, CUDA context or memory from another: a trial's peak does not depend on the trials before it.

Inside the trial: build the model and AdamW, ``warmup_steps`` steps (AdamW allocates its state and
Triton autotunes there), synchronize, reset the peaks, then ``measured_steps`` steps of forward,
backward and ``optimizer.step()``, each timed after a synchronize (torch.utils.benchmark's habit).
Out-of-memory is caught here, by :func:`vramcal.measure.meters.is_out_of_memory`, and nowhere else.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from vramcal.model import ModelSpec
from vramcal.records import Device, Trial


@dataclass(frozen=True)
class TrialRequest:
    """What a trial process needs: picklable, sent to the child."""

    spec: ModelSpec
    implementation: str
    batch_size: int
    device: Device
    warmup_steps: int = 1
    measured_steps: int = 2
    host_memory_limit_bytes: int | None = None
    seed: int = 0


class TrialRunner:
    """Runs trials in fresh processes forked from a preloaded fork server.

    Args:
        timeout_s: a trial still running after this many seconds is killed and recorded as ``timeout``.

    The host's trials run under ``RLIMIT_DATA = host_memory_limit_bytes`` (by default the device's
    total_bytes), so a trial that would exceed the budget fails with the CPU allocator's out-of-memory
    error, as a GPU trial fails with CUDA's, instead of pushing the host into swap or the OOM killer.
    """

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["vramcal.measure._preload"])

    def run(self, request: TrialRequest, purpose: str = "") -> Trial:
        """Run one trial; never raises for what happens inside the trial process."""
        receiver, sender = self._context.Pipe(duplex=False)
        started = time.time()
        process = self._context.Process(target=_child, args=(sender, request, started, os.getpid()),
                                        daemon=True)
        process.start()
        sender.close()
        result: dict[str, Any] | None = None
        if receiver.poll(self.timeout_s):
            try:
                result = receiver.recv()
            except EOFError:
                result = None
        else:
            process.kill()
            result = {"status": "timeout", "error": f"killed after the {self.timeout_s:.0f} s time limit"}
        process.join()
        receiver.close()
        if result is None:
            result = _exit_status(process.exitcode)
        return Trial(batch_size=request.batch_size, purpose=purpose, wall_s=time.time() - started, **result)


def _exit_status(exitcode: int | None) -> dict[str, Any]:
    if exitcode == -9:
        return {"status": "oom", "error": "trial process killed by SIGKILL (the kernel's OOM killer?)"}
    return {"status": "error", "error": f"trial process exited with code {exitcode} without a result"}


def _child(sender: Any, request: TrialRequest, started: float, caller_pid: int) -> None:
    """Entry point of the trial process: measure, then send one result dict."""
    startup_s = time.time() - started
    threading.Thread(target=_exit_with_caller, args=(caller_pid,), daemon=True).start()
    try:
        result = measure(request)
    except BaseException as error:  # noqa: BLE001 - everything becomes a recorded status
        result = _failure(error)
    result["startup_s"] = startup_s
    sender.send(result)
    sender.close()


def _failure(error: BaseException) -> dict[str, Any]:
    """The result of a trial that raised: ``oom`` or ``error`` with the traceback's last lines.

    The traceback's frames still hold the step's tensors; they are cleared first, so that reporting an
    out-of-memory error does not itself run out of memory (a trial at the limit would otherwise die
    with no result).
    """
    from vramcal.measure.meters import is_out_of_memory

    status = "oom" if is_out_of_memory(error) else "error"
    traceback.clear_frames(error.__traceback__)
    gc.collect()
    try:
        tail = "".join(traceback.format_exception(error)[-3:]).strip()[-1500:]
    except MemoryError:
        tail = f"{type(error).__name__} (no memory left to format its traceback)"
    return {"status": status, "error": tail}


def _exit_with_caller(caller_pid: int, interval_s: float = 0.5) -> None:
    """End this trial when the process that asked for it is gone (a killed probe must not leave a
    trial holding gigabytes: the fork server, not the caller, is the trial's parent)."""
    while True:
        try:
            os.kill(caller_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(interval_s)


def measure(request: TrialRequest) -> dict[str, Any]:
    """Build the model, warm up, and measure training steps; returns the Trial fields it measured.

    Runs in the trial process. Input ``x``: (batch_size, seq_len, n_features) float32 standard normal;
    target: (batch_size, seq_len) float32; loss: mean squared error, as in ``vramcal train``.

    Raises:
        torch.OutOfMemoryError / RuntimeError: allocation failures, classified by the caller.
    """
    device = request.device
    if device.kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = device.uuid or ""  # pin by UUID before CUDA initialises
        return _measure_cuda(request)
    if request.host_memory_limit_bytes is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (request.host_memory_limit_bytes,) * 2)
    return _measure_host(request)


def _training_setup(request: TrialRequest, torch_device: str):
    import torch

    from vramcal.model import build_model
    from vramcal.train.step import make_optimizer, train_step

    torch.manual_seed(request.seed)
    spec = request.spec
    model = build_model(spec, request.implementation).to(torch_device)
    optimizer = make_optimizer(model, lr=1e-4)
    x = torch.randn(request.batch_size, spec.seq_len, spec.n_features, device=torch_device)
    y = torch.randn(request.batch_size, spec.seq_len, device=torch_device)

    def step() -> None:
        train_step(model, optimizer, x, y, spec.dtype, torch_device)

    return step


def _timed_steps(step, n_steps: int, device_kind: str) -> list[float]:
    from vramcal.measure.meters import synchronize

    times = []
    for _ in range(n_steps):
        start = time.perf_counter()
        step()
        synchronize(device_kind)
        times.append(time.perf_counter() - start)
    return times


def _measure_host(request: TrialRequest) -> dict[str, Any]:
    from vramcal.measure.meters import host_peaks, reset_peak_rss

    start = time.perf_counter()
    step = _training_setup(request, "cpu")
    build_s = time.perf_counter() - start
    _timed_steps(step, request.warmup_steps, "host")
    reset_peak_rss()
    step_times = _timed_steps(step, request.measured_steps, "host")
    return _summary(request, step_times, build_s, **host_peaks())


def _measure_cuda(request: TrialRequest) -> dict[str, Any]:
    from vramcal.measure import meters
    from vramcal.measure.device import load_nvml, nvml_handle

    nvml = load_nvml()
    with meters.NvmlSampler(nvml, nvml_handle(nvml, request.device)) as sampler:
        start = time.perf_counter()
        step = _training_setup(request, "cuda")
        build_s = time.perf_counter() - start
        _timed_steps(step, request.warmup_steps, "cuda")
        meters.torch_cuda_reset_peaks()
        nvml_overhead = sampler.current_bytes() - meters.torch_cuda_reserved_bytes()
        sampler.reset_peaks()
        step_times = _timed_steps(step, request.measured_steps, "cuda")
    return _summary(request, step_times, build_s, **meters.cuda_peaks(sampler, nvml_overhead))


def _summary(request: TrialRequest, step_times: list[float], build_s: float, **figures: Any) -> dict[str, Any]:
    step_s = statistics.median(step_times)
    return {"status": "ok", "step_s": step_s, "samples_per_s": request.batch_size / step_s,
            "build_s": build_s, **figures}
