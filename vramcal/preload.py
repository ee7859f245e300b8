"""What the worker fork server imports once, so every worker — trial or training run — starts with the same
modules already imported (torch and transformers take seconds each on a small CPU) and the same process
make-up: the model families, the trainer's data libraries (pandas, pyarrow), its loop and its progress bars.

The callers own it (:func:`vramcal.api.worker_pool` names it to :class:`vramcal.measure.worker.Workers`),
so the process layer below knows nothing of what runs on it. Nothing imports this module but the server.

pyarrow's default memory pool is the system allocator in workers (:class:`~vramcal.measure.worker.Workers`
starts the server with ``ARROW_DEFAULT_MEMORY_POOL=system``; pyarrow reads it once, at load):
jemalloc/mimalloc keep address space after a read, which the host budget's ``RLIMIT_DATA`` counts (about
1 GiB on the E-mini bars). tqdm's monitor thread is switched off: a thread's stack is 8 MiB of data
segment, and a worker should not carry threads that depend on whether a progress bar was drawn. Its lock is a
thread lock: a worker's bars are its own process's, and tqdm's default holds a ``multiprocessing`` RLock, a named
semaphore that a worker killed (``kill -9``, or by its caller on Ctrl-C) never unlinks, so multiprocessing's
resource tracker warned of "leaked semaphore objects" as the command ended. Nothing
here may start CUDA: the server runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (so ``torch.cuda.is_available()``
asks NVML, not the driver), and each worker checks that it inherited no CUDA state
(:func:`vramcal.measure.worker.cuda_started`).
"""

import threading

import pandas  # noqa: F401
import pyarrow.parquet  # noqa: F401
import torch  # noqa: F401
import tqdm

import vramcal.models.lm  # noqa: F401
import vramcal.models.regressor  # noqa: F401
import vramcal.train.loop  # noqa: F401
import vramcal.train.worker  # noqa: F401
import vramcal.workload  # noqa: F401
from vramcal.models.mamba2 import import_transformers_mamba2

tqdm.tqdm.monitor_interval = 0
tqdm.tqdm.set_lock(threading.RLock())
import_transformers_mamba2()
