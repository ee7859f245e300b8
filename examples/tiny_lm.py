"""What the four framework examples share: a tiny Mamba-2 language model, random tokens, the command line, and
the model's vramcal profile (the one under ``--profiles-dir`` when it matches, else calibrated there, once).

The examples train on the host (the CPU): ``--capacity`` is the budget the calibration's trials run under
(``RLIMIT_DATA``) and size against. It must leave room above what a trial's process holds when it starts
(about 0.5 GiB with the CPU build of torch, about 1 GiB with PyPI's CUDA build, which runs on the CPU too); the
larger the budget, the larger the batches and the longer the calibration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import vramcal
from vramcal.profile import DEFAULT_PROFILES_DIR

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mamba2-lm-tiny.json"  # 89 k parameters, vocab 512
SEQ_LEN = 32  # tokens per sample; a multiple of the config's chunk_size (16)
# What vramcal calibrates: its "lm" family builds transformers' Mamba2ForCausalLM from this config and trains it
# on random tokens of SEQ_LEN. The profile keeps the config's settings (not the path) and is found by them.
PARAMS = {"config": str(CONFIG), "seq_len": SEQ_LEN}


def parse_args(description: str) -> argparse.Namespace:
    """The options every example takes: ``--profiles-dir``, ``--steps``, ``--capacity``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles-dir", default=DEFAULT_PROFILES_DIR, type=Path,
                        help="where the profile is found, or calibrated into (default: %(default)s)")
    parser.add_argument("--steps", default=5, type=int, help="optimizer steps to train (default: %(default)s)")
    # The same room above a trial's process at its start (module docstring) with either build of torch. The room
    # must also hold the conservative size's headroom (a tenth of the safe batch) above what a framework's process
    # holds beyond the trials' when training starts, 10-50 MiB here: at 1.2GiB that headroom was 14 MiB, and an HF
    # Trainer holding 18 MiB more was stopped; at 1.6GiB it is about 50 MiB.
    parser.add_argument("--capacity", default="2.2GiB" if torch.version.cuda else "1.6GiB",
                        help="the host budget the profile is calibrated at, as 1.6GiB or bytes (default: %(default)s)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    return args


def profile_path(args: argparse.Namespace) -> Path:
    """The profile file of the tiny model on this host at ``--capacity``: the matching one under
    ``--profiles-dir`` (same model, budget and software), else a new calibration there (real trials in
    separate processes, a line each on stderr; 15-40 s at 1.6GiB on two cores)."""
    answered = vramcal.size_for(
        "lm", PARAMS, gpu="none", capacity_bytes=args.capacity, profiles_dir=args.profiles_dir,
        trials=vramcal.TrialSettings(boundary=False))  # no trials at the out-of-memory edge: quicker, an example
    if not answered.calibrated:  # a calibration has said so itself, a line per trial and where it saved the profile
        print(f"vramcal: {answered.reason}", file=sys.stderr)
    return answered.path


def tiny_lm() -> torch.nn.Module:
    """The model the profile describes: transformers' ``Mamba2ForCausalLM`` as the ``lm`` family imports it (its
    PyTorch path, as the trials ran it), with random weights."""
    from vramcal.models.lm import mamba2_config, read_config
    from vramcal.models.mamba2 import import_transformers_mamba2

    torch.manual_seed(0)
    return import_transformers_mamba2().Mamba2ForCausalLM(mamba2_config(read_config(str(CONFIG))))


class Tokens(torch.utils.data.Dataset):
    """Random token ids, each sample ``{"input_ids", "labels"}: (SEQ_LEN,) int64`` (the labels are the ids:
    transformers shifts them for the next-token loss), drawn from the sample's index."""

    def __init__(self, n: int = 100_000, vocab_size: int = 512) -> None:
        self.n, self.vocab_size = n, vocab_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}
