"""The training step shared by ``vramcal probe`` (each trial) and ``vramcal train``.

Both call these functions, so the memory a trial measures is the memory of the trainer's step:
forward under the dtype policy, mean-squared-error loss in fp32, backward, gradient clipping,
AdamW step, gradients set to None.
"""

from __future__ import annotations

import torch
from torch import nn


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """AdamW over all trainable parameters (torch's default foreach implementation)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def forward(model: nn.Module, x: torch.Tensor, dtype_policy: str, device_type: str) -> torch.Tensor:
    """The model under the dtype policy: (batch_size, seq_len, n_features) -> (batch_size, seq_len).

    ``bf16-autocast`` runs under bf16 autocast on CUDA (fp32 weights); elsewhere everything is fp32.
    """
    autocast = dtype_policy == "bf16-autocast" and device_type == "cuda"
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        return model(x)


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype_policy: str,
                     device_type: str, loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of one (micro-)batch; gradients accumulate into ``.grad``.

    Args:
        x: (batch_size, seq_len, n_features) float32. y: (batch_size, seq_len) float32 targets.
        dtype_policy: ``fp32``, or ``bf16-autocast`` (bf16 autocast on CUDA; fp32 elsewhere).
        loss_scale: the loss is multiplied by this before backward (1 / micro-batches when
            accumulating), so accumulated gradients equal those of the full batch.

    Returns:
        The unscaled mean-squared-error loss, detached, float32 scalar.
    """
    prediction = forward(model, x, dtype_policy, device_type)  # (B, L)
    loss = nn.functional.mse_loss(prediction.float(), y)
    (loss * loss_scale).backward()
    return loss.detach()


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                   skip_non_finite: bool = False) -> torch.Tensor:
    """Clip gradients to ``max_grad_norm`` (L2 over all parameters), step, and free the gradients.

    Args:
        skip_non_finite: when the gradient norm is NaN or infinite, free the gradients without stepping,
            so the weights stay the last good ones (the trainer then stops; the probe never skips).

    Returns:
        The total gradient norm before clipping (float32 scalar tensor; non-finite if a gradient is).
    """
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if skip_non_finite and not bool(torch.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               dtype_policy: str, device_type: str, max_grad_norm: float = 1.0) -> torch.Tensor:
    """One full step on one batch: :func:`forward_backward` then :func:`optimizer_step`; returns the loss."""
    loss = forward_backward(model, x, y, dtype_policy, device_type)
    optimizer_step(model, optimizer, max_grad_norm)
    return loss
