"""The regressor's ``nn.Module`` classes: an input projection, a library's Mamba-2 backbone and a linear head."""

from __future__ import annotations

import types
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vramcal.models.mamba2 import checkpoint_blocks

# FSDP2 warns that the root returns a view (the head's squeeze), in case the caller changes it in place: the
# regressor's loss reads it out of place, so the warning says nothing here (it would print once per rank)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMamba2Regressor\) returned a view tensor")


class Mamba2Regressor(nn.Module):
    """Input projection -> Mamba-2 backbone -> linear head, one prediction per position.

    ``forward(x)``: ``x`` (batch_size, seq_len, n_features) float32 -> (batch_size, seq_len) float32.
    """

    def __init__(self, n_features: int, d_model: int, backbone: nn.Module) -> None:
        super().__init__()
        self.input_proj = nn.Linear(n_features, d_model)
        self.backbone = backbone
        self.head = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.input_proj(x)  # (B, L, n_features) -> (B, L, d_model)
        hidden = self.backbone(hidden)  # (B, L, d_model), final-normed
        return self.head(hidden).squeeze(-1)  # (B, L, 1) -> (B, L)


class TransformersBackbone(nn.Module):
    """``transformers.Mamba2Model`` fed through ``inputs_embeds``: (B, L, d_model) -> (B, L, d_model); its unused
    one-row embedding frozen (DDP then finds no parameter without a gradient)."""

    def __init__(self, modeling: types.ModuleType, spec) -> None:
        super().__init__()
        from transformers import Mamba2Config

        config = Mamba2Config(
            hidden_size=spec.d_model, num_hidden_layers=spec.n_layers, state_size=spec.d_state,
            head_dim=spec.headdim, expand=spec.expand, num_heads=spec.n_heads, n_groups=spec.n_groups,
            chunk_size=spec.chunk_size, conv_kernel=spec.d_conv, vocab_size=1, pad_token_id=0,
            bos_token_id=0, eos_token_id=0, use_cache=False, residual_in_fp32=True)
        self.model = modeling.Mamba2Model(config)
        self.model.get_input_embeddings().weight.requires_grad_(False)
        checkpoint_blocks(self.model, spec.checkpoint_stride)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=hidden, use_cache=False).last_hidden_state


class MambaSsmBackbone(nn.Module):
    """Pre-norm residual stack of ``mamba_ssm`` Mamba2 mixers, mamba_ssm's ``MixerModel`` without its embedding:
    ``h = h + Mamba2(RMSNorm(h))`` per layer, a final RMSNorm; (B, L, d_model) -> (B, L, d_model). The residual
    stream is fp32, as transformers' with ``residual_in_fp32=True``; every ``checkpoint_stride``-th block from the
    first is recomputed in the backward pass (``checkpoint(..., use_reentrant=False)``)."""

    def __init__(self, mamba2: types.ModuleType, spec) -> None:
        super().__init__()
        from mamba_ssm.ops.triton.layer_norm import RMSNorm

        self.norms = nn.ModuleList(RMSNorm(spec.d_model) for _ in range(spec.n_layers))
        self.mixers = nn.ModuleList(
            mamba2.Mamba2(d_model=spec.d_model, d_state=spec.d_state, d_conv=spec.d_conv,
                          expand=spec.expand, headdim=spec.headdim, ngroups=spec.n_groups,
                          chunk_size=spec.chunk_size, use_mem_eff_path=True, layer_idx=i)
            for i in range(spec.n_layers))
        self.norm_f = RMSNorm(spec.d_model)
        self.checkpoint_stride = spec.checkpoint_stride

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.float()  # (B, L, d_model) fp32: the residual stream
        recompute = self.checkpoint_stride and self.training and torch.is_grad_enabled()
        for index, (norm, mixer) in enumerate(zip(self.norms, self.mixers)):
            if recompute and index % self.checkpoint_stride == 0:
                hidden = checkpoint(_block, norm, mixer, hidden, use_reentrant=False)
            else:
                hidden = _block(norm, mixer, hidden)
        return self.norm_f(hidden)


def _block(norm: nn.Module, mixer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One pre-norm residual block: (B, L, d_model) fp32 -> (B, L, d_model) fp32."""
    return hidden + mixer(norm(hidden))
