"""Imported once by the trial fork server, so each trial process starts with torch and the
transformers Mamba-2 module already imported (several seconds each on a small CPU).

It also imports what ``vramcal train`` imports to read its data (pandas, pyarrow): on the host, a
trial's peak is the process's resident set, and the trainer's process carries those libraries too.
"""

import pandas  # noqa: F401
import pyarrow.parquet  # noqa: F401
import torch  # noqa: F401

import vramcal.train.step  # noqa: F401
from vramcal.model import import_transformers_mamba2

import_transformers_mamba2()
