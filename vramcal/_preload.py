"""Imported once by the trial fork server, so each trial process starts with torch and the
transformers Mamba-2 module already imported (several seconds each on a small CPU)."""

import torch  # noqa: F401

import vramcal.train.step  # noqa: F401
from vramcal.model import import_transformers_mamba2

import_transformers_mamba2()
