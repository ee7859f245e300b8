"""What the worker fork server imports once, so every worker (trial or training run) starts with the same modules
and process make-up (:func:`vramcal.api.worker_pool` names it; nothing else imports it).

tqdm's monitor thread is off (a thread's stack is 8 MiB of data segment) and its lock is a thread lock (its default
``multiprocessing`` RLock is a named semaphore a killed worker never unlinks). Nothing here may start CUDA: each
worker checks it inherited none (:func:`vramcal.measure.worker.cuda_started`).
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
