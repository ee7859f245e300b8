"""Factories as a user writes them: plain PyTorch, importable by name (``user_models:mlp``), plus broken ones.

vramcal imports this module in its trial processes, so it must be importable there: under pytest the
``tests`` folder is on ``sys.path`` (pytest puts it there for ``conftest.py``), and the worker fork
server starts with the caller's ``sys.path``.
"""

from __future__ import annotations

import torch

import vramcal


class MLP(torch.nn.Module):
    """A plain regressor: (batch_size, n_features) fp32 -> (batch_size, 1) fp32."""

    def __init__(self, n_features: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(n_features, width), torch.nn.GELU(),
                                          torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n_features) -> (B, 1)
        return self.layers(x)


def mlp(device: torch.device, *, n_features: int = 16384, width: int = 8, lr: float = 1e-3,
        seed: int = 0) -> vramcal.TrainingStep:
    """A tiny MLP regressor's training step; batches are (x: (B, n_features), y: (B, 1)) fp32 on ``device``.

    Wide inputs and a narrow model: 64 KiB of input per sample at the defaults, little compute, so a
    budget of a few hundred MiB is reached at a few thousand samples in well under a second per step.
    """
    torch.manual_seed(seed)
    model = MLP(n_features, width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator(device=device).manual_seed(seed)

    def batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, n_features, device=device, generator=generator)
        return x, x[:, :1].clone()

    def loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    return vramcal.TrainingStep(model=model, optimizer=optimizer, batch=batch, loss=loss,
                                info={"n_params": sum(p.numel() for p in model.parameters())})


# ------------------------------------------------------------------------------- broken factories

not_callable = 42


def raises(device: torch.device, **params) -> vramcal.TrainingStep:
    raise ValueError("width must be a multiple of 64\n(a second line that must not be printed)")


def wrong_type(device: torch.device, **params) -> torch.nn.Module:
    return MLP(4, 4)


def loss_raises(device: torch.device, **params) -> vramcal.TrainingStep:
    step = mlp(device, n_features=16, width=16)

    def loss(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x16 and 32x16)")

    step.loss = loss
    return step


def chatty(device: torch.device, **params) -> vramcal.TrainingStep:
    """:func:`mlp`, printing to stdout as user code does (``probe --json`` must keep stdout JSON only)."""
    print("chatty: building the model", flush=True)
    return mlp(device, **params)


def process_state(channel=None) -> dict:
    """What a worker forked from vramcal's preloaded server holds (test_probe_real: fork safety)."""
    import os
    import sys

    from vramcal.measure.worker import cuda_started

    return {"torch_imported": "torch" in sys.modules, "cuda_started": cuda_started(),
            "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}


def worker_environment(channel=None) -> dict:
    """The settings a worker runs with that differ by the kind of device it measures (test_gpu_path)."""
    import os

    names = ("GLIBC_TUNABLES", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
             "ARROW_DEFAULT_MEMORY_POOL", "PYTORCH_NVML_BASED_CUDA_CHECK")
    return {name: os.environ.get(name) for name in names}


def lm_with_kernels(device: torch.device, *, config: str, seq_len: int) -> vramcal.TrainingStep:
    """A user's Mamba-2 language model with mamba_ssm's kernels bound, however the device treats them:
    transformers' ``modeling_mamba2`` imported with mamba_ssm visible (test_lm: the kernel path recorded)."""
    from vramcal.models.lm import read_config, training_step

    return training_step(device, config=read_config(config), seq_len=seq_len, implementation="mamba_ssm")


def killed_from_outside(device: torch.device, *, kill_at: int, **params) -> vramcal.TrainingStep:
    """:func:`mlp`, whose worker is killed by SIGKILL (as ``kill -9`` or a scheduler's preemption kills it) when
    a batch of ``kill_at`` samples or more is made: no out-of-memory kill for the kernel to count."""
    import os
    import signal

    step = mlp(device, **params)
    make = step.batch

    def batch(batch_size: int):
        if batch_size >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return make(batch_size)

    step.batch = batch
    return step


def kill_myself(reading_bytes: int | None = None, channel=None) -> None:
    """A worker function that SIGKILLs its own process, as ``kill -9 <pid>`` from outside does; first it sends
    ``reading_bytes`` as its meter's reading, when given."""
    import os
    import signal

    if reading_bytes is not None:
        channel.reading(reading_bytes)
    os.kill(os.getpid(), signal.SIGKILL)
