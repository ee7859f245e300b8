"""A card's step traced on CPU tensors as the card runs it (issue 57): each twin on a tiny model whose CUDA allocations
are known from the op's source, and mamba_ssm's fused path against its own ``save_for_backward``."""

import pytest
import torch
from fused import fused_path  # noqa: F401 - a fixture
from torch._subclasses.fake_tensor import FakeTensorMode

from vramcal.estimate import estimate_step
from vramcal.estimate.card import Card, as_card, sdp_backend
from vramcal.estimate.trace import StorageTrace
from vramcal.models.regressor.spec import RegressorSpec

MIB = 2**20


def kept_after(run, *, card=None):
    """Bytes of the storages ``run()`` allocated that are alive when it returns (its result's own excluded), traced on
    fake CPU tensors (as ``card`` runs them when given), and the choices made."""
    with FakeTensorMode(allow_non_fake_inputs=True), StorageTrace() as trace:
        with as_card(card) if card else _nothing() as choices:
            out = run()
        alive = {}
        for event in trace.events:
            if event.kind == "alloc":
                alive[event.key] = event.size_bytes
            else:
                alive.pop(event.key, None)
        own = sum(t.untyped_storage().nbytes() for t in (out if isinstance(out, tuple) else (out,)))
    return sum(alive.values()) - own, choices


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_dropout_keeps_cudas_bool_mask_not_the_cpus_float_mask():
    """``F.dropout`` on a (64, 1024) fp32 activation that requires grad: CUDA's fused native_dropout keeps a bool mask,
    1 byte per element (Dropout.cu); the CPU's ``_dropout_impl`` keeps a float mask, 4 bytes per element."""
    def run():
        x = torch.randn(64, 1024, requires_grad=True)
        return torch.nn.functional.dropout(x, 0.1, training=True)

    cpu, _ = kept_after(run)
    cuda, choices = kept_after(run, card=Card())
    assert cpu - 64 * 1024 * 4 == 64 * 1024 * 4  # the input (4 B/element), and its float mask
    assert cuda - 64 * 1024 * 4 == 64 * 1024 * 1  # the input, and a 1-byte mask
    assert any(line.startswith("dropout: CUDA's fused native_dropout") for line in choices.lines())


def test_a_checkpointed_block_recomputes_its_dropout_and_attention_as_the_card_ran_them():
    """A checkpointed block (``use_reentrant=False``) recomputes its forward pass in the backward, where torch checks
    the recomputed tensors against those saved: the card's dropout mask (bool) and attention backend must hold there
    too (a torch-function mode does not reach the recomputation: CheckpointError, bool against float32)."""
    def block(x):
        q = torch.nn.functional.dropout(x, 0.1, training=True).unflatten(-1, (4, 16)).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    with FakeTensorMode(allow_non_fake_inputs=True), as_card(Card()) as choices:
        x = torch.randn(2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        assert x.grad.shape == x.shape
    assert [line.split(":")[0] for line in choices.lines()] == ["dropout", "attention"]


@pytest.mark.parametrize(("capability", "dtype", "mask", "expected"), [
    ((9, 0), torch.bfloat16, False, "flash"), ((8, 0), torch.float16, False, "flash"),
    ((9, 0), torch.float32, False, "efficient"), ((9, 0), torch.bfloat16, True, "efficient"),
    ((7, 5), torch.float16, False, "efficient")])
def test_the_attention_backend_is_the_one_torch_picks_on_the_card(capability, dtype, mask, expected):
    q = torch.empty(2, 4, 128, 64, dtype=dtype, requires_grad=True)
    attn_mask = torch.zeros(128, 128, dtype=torch.bool) if mask else None
    assert sdp_backend(Card("x", capability, 100), q, q, q, attn_mask, 0.0, False) == expected


def test_flash_attention_keeps_a_logsumexp_per_query_not_the_weights():
    """(B, H, L, D) = (2, 4, 512, 64) bf16 with grad, causal: flash keeps q, k, v, the output and a logsumexp of
    B x H x L fp32 (``_scaled_dot_product_flash_attention``'s outputs), never the L x L weights the math path keeps."""
    def run():
        q, k, v = (torch.randn(2, 4, 512, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    cuda, choices = kept_after(run, card=Card())
    inputs, weights = 3 * 2 * 4 * 512 * 64 * 2, 2 * 4 * 512 * 512 * 2
    assert cuda - inputs == 2 * 4 * 512 * 4 + 16 + 8  # the logsumexp, and the philox seed and offset
    assert cuda - inputs < weights
    assert any(line.startswith("attention: flash") for line in choices.lines())


def test_adamw_on_a_card_runs_foreach_whose_temporaries_the_trace_holds():
    """AdamW's first step on 8 weights of 256 KiB: on CUDA parameters torch picks foreach, whose ``_foreach_sqrt`` of
    the second moments is one temporary per weight, all alive at once (``torch/optim/adamw.py``,
    ``_multi_tensor_adamw``);
    the CPU's per-parameter loop holds three of one weight at its most (``_single_tensor_adamw``): 5 more."""
    from vramcal.estimate.trace import live_peak

    def peak(card):
        with FakeTensorMode(allow_non_fake_inputs=True), StorageTrace() as trace:
            model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(8)))
            optimizer = torch.optim.AdamW(model.parameters())
            with as_card(card, optimizer) if card else _nothing():
                model(torch.randn(4, 256)).sum().backward()
                start = len(trace.events)
                optimizer.step()
        return live_peak(trace, "cpu", start)[0], optimizer.param_groups[0]["foreach"]

    (cpu, cpu_foreach), (cuda, cuda_foreach) = peak(None), peak(Card())
    assert cpu_foreach is None and cuda_foreach is True
    assert cuda - cpu == 5 * 256 * 256 * 4


def test_cudas_autocast_lists_replace_the_cpus_in_the_trace():
    """``exp`` of a bf16 tensor under bf16 autocast: CUDA's list runs it in fp32 (autocast_mode.cpp, ``exp`` fp32),
    the CPU's leaves it bf16 (``softplus`` too); matrix products are bf16 under both; ``torch.is_autocast_enabled()``
    answers as on the card;
    outside the trace the CPU's lists are back."""
    with FakeTensorMode():
        x = torch.randn(8, 8)
        with as_card(Card()), torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled() and torch.get_autocast_gpu_dtype() == torch.bfloat16
            assert torch.exp(x.bfloat16()).dtype == torch.float32
            assert torch.nn.functional.softplus(x.bfloat16()).dtype == torch.float32
            assert torch.nn.functional.log_softmax(x.bfloat16(), -1).dtype == torch.float32  # dtype given positionally
            assert torch.cumsum(x.bfloat16(), 0).dtype == torch.float32  # dtype a keyword
            assert (x @ x).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.exp(x.bfloat16()).dtype == torch.bfloat16
            assert torch.nn.functional.softplus(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("batch_size", [1, 3])
def test_each_fused_layer_keeps_what_mamba_ssms_save_for_backward_keeps(fused_path, batch_size):  # noqa: F811
    """One mamba_ssm Mamba2 layer (d_model 768, d_state 128, headdim 64, chunk 256, seq_len 512, fp32) traced forward:
    the bytes it keeps for backward are, to the byte, the storages its autograd graph saved (every
    ``save_for_backward``,
    seen by ``saved_tensors_hooks``) less the input and the weights, and those are mamba_split_conv1d_scan_combined's:
    zxbcdt (B, L, 2·d_inner + 2·d_state + nheads), the scan's out_x (B, L, d_inner) and the norm's rstd (B·L) in fp32,
    and A = -exp(A_log) (nheads; the exp's output kept by its own backward too)."""
    from vramcal.estimate.fused import fused_twins
    from vramcal.models.mamba2 import import_mamba_ssm_mamba2

    saved = {}

    def pack(tensor):
        saved[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True), as_card(Card()) as choices, fused_twins(choices):
        layer = import_mamba_ssm_mamba2().Mamba2(d_model=768, d_state=128, headdim=64, chunk_size=256,
                                                 use_mem_eff_path=True)
        x = torch.randn(batch_size, 512, 768, requires_grad=True)
        before = {id(t.untyped_storage()) for t in (x, *layer.parameters())}
        with StorageTrace() as trace, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x)
        alive = {}
        for event in trace.events:
            alive[event.key] = event.size_bytes if event.kind == "alloc" else alive.pop(event.key, None) and None
        kept = sum(v for v in alive.values() if v) - out.untyped_storage().nbytes()
    by_hooks = sum(size for key, size in saved.items() if key not in before)
    d_inner, nheads = 1536, 24
    by_source = batch_size * 512 * ((2 * d_inner + 2 * 128 + nheads) + d_inner + 1) * 4 + 2 * nheads * 4
    assert kept == by_hooks == by_source
    assert choices.launched


def test_the_fused_path_keeps_several_times_fewer_bytes_per_sample(fused_path):  # noqa: F811
    spec = RegressorSpec(d_model=64, n_layers=2, d_state=32, headdim=32, chunk_size=64, seq_len=256)
    torch_path = estimate_step(spec.ref("transformers"), (4, 16), device_kind="cuda")
    fused = estimate_step(spec.ref("mamba_ssm"), (4, 16), device_kind="cuda")
    assert "fused" in fused.kernel_path and "torch_forward" in torch_path.kernel_path
    assert fused.slope_bytes_per_sample * 2 < torch_path.slope_bytes_per_sample
    assert any(line.startswith("fused kernels:") for line in fused.choices)


def test_the_lm_familys_fused_path_is_traced_on_the_kernels(fused_path):  # noqa: F811
    """transformers 5.25 sends CPU tensors to its PyTorch path (``hub_kernels._PACKAGE_SUPPORTED_DEVICES``): within
    the twins they reach mamba_ssm's kernels, so the lm family's mamba_ssm path keeps the fused layers' bytes (before,
    the trace launched no kernel and the estimate refused the path)."""
    from pathlib import Path

    from vramcal.models import lm
    from vramcal.workload import ModelRef

    config = lm.read_config(Path(__file__).resolve().parent.parent / "configs" / "mamba2-lm-tiny.json")
    traced = {impl: estimate_step(ModelRef.make(lm.FACTORY, {"config": config, "seq_len": 64, "dtype": "bf16-autocast",
                                                             "implementation": impl}), (2, 8), device_kind="cuda")
              for impl in ("transformers", "mamba_ssm")}
    assert any(line.startswith("fused kernels:") for line in traced["mamba_ssm"].choices)
    assert not any(line.startswith("fused kernels:") for line in traced["transformers"].choices)
    assert traced["mamba_ssm"].slope_bytes_per_sample < traced["transformers"].slope_bytes_per_sample


def test_each_card_is_traced_as_itself_once_per_group_that_answers_the_trace_alike(fused_path):  # noqa: F811
    """The torch path asks a card only its cuBLAS workspace (Hopper's is larger), so an H100 and an H200 share one
    trace and an A100 gets its own; the fused path reads the SM count (mamba_ssm sizes a backward buffer by it), so
    an RTX 3060 (28 SMs) and an A4000 (48) of one compute capability are traced apart, each with its own bytes."""
    from vramcal.estimate.learned import estimate_cards
    from vramcal.report.catalogue import CATALOGUE

    cards = {m.label.split()[0] + m.label.split()[1]: m for m in CATALOGUE}
    spec = RegressorSpec(d_model=64, n_layers=2, d_state=32, headdim=32, chunk_size=64, seq_len=256)
    torch_path = estimate_cards(spec.ref("transformers"), {}, refs=[spec.ref("transformers")],
                                cards=[cards["H10080"], cards["A10040"], cards["H200141"]])
    assert [e.traits for e in torch_path.estimates] == [("workspace",), ("workspace",)]
    assert [r.card for r in torch_path.rows] == ["H100 80 GB (HBM3)", "A100 40 GB (SXM4)", "H200 141 GB"]
    assert torch_path.formulas[0].startswith("H100 80 GB (HBM3), H200 141 GB, transformers")
    h100, a100 = torch_path.estimates
    assert h100.overhead_bytes - a100.overhead_bytes >= 16 * 2**20  # Hopper's workspaces, held for good
    fused = estimate_cards(spec.ref("mamba_ssm"), {}, cards=[cards["RTX3060"], cards["RTXA4000"]],
                           refs=[spec.ref("mamba_ssm")])
    assert "sm_count" in fused.estimates[0].traits and len(fused.estimates) == 2
    assert fused.estimates[0].choices != fused.estimates[1].choices  # each names its own SM count
    assert fused.estimates[0].points[0].peak_bytes != fused.estimates[1].points[0].peak_bytes or \
        fused.estimates[0].points[0].allocated_peak_bytes != fused.estimates[1].points[0].allocated_peak_bytes


def test_a_calibrations_aim_traces_the_card_it_calibrates(tmp_path):
    """The aim of a probe of an A100 traced an H100 (Hopper's larger workspace); now the device's own compute
    capability, and the catalogue entry's SM count where the catalogue has the card."""
    from vramcal.estimate.learned import aim_for
    from vramcal.records import Device
    from vramcal.report.catalogue import CATALOGUE

    asked = []

    def trace(ref, options, kind, card):
        asked.append(card)
        return estimate_step(ref, (8, 512), device_kind=kind, card=card)

    ref = RegressorSpec(d_model=32, n_layers=1, d_state=16, headdim=16, chunk_size=16, seq_len=32).ref("transformers")
    a100 = Device(kind="cuda", name="NVIDIA A100-SXM4-40GB", total_bytes=40 * 2**30, total_source="nvml",
                  compute_capability="8.0")
    listed = next(card for card in CATALOGUE if card.nvml_name == a100.name)
    assert aim_for(ref, {}, a100, tmp_path, trace, listed)[0] is not None
    assert aim_for(ref, {}, a100, tmp_path, trace)[0] is not None
    assert [(c.compute_capability, c.sm_count) for c in asked] == [((8, 0), 108), ((8, 0), Card().sm_count)]
