"""python creep_probe.py mixed|fixed (from the repository root, after bench.lm_train wrote run/run.json): the
data-segment peak and VmData (MiB) every 20 steps of the tiny lm on the run's budget batches, or on its worst
batch (46 x 80) alone."""
import json
import sys

import torch

from vramcal.calibration.lengths import TokenBudget
from vramcal.measure.device import host_device
from vramcal.measure.meters import peak_data_bytes, read_status_bytes
from vramcal.models.corpus import lengths, load_corpus
from vramcal.models.registry import model_ref
from vramcal.sizing.sampler import LengthBatchSampler
from vramcal.train.lm_loop import tensors
from vramcal.workload import build, optimizer_step

mode = sys.argv[1]
ref = model_ref("lm", {"config": "configs/mamba2-lm-tiny.json", "seq_len": 1024, "dtype": "fp32"},
                device=host_device(), implementation="transformers")
step = build(ref, torch.device("cpu"), {"lr": 5e-5, "seed": 0})
corpus = load_corpus("stdlib", 1024, 0.02)
prof = json.load(open("bench/results/lm-train/run/run.json"))["data"]["batching"]["budget"]
s = LengthBatchSampler(lengths(corpus.train), budget=TokenBudget.from_dict(prof), seed=0)
batches = s.batches()
worst = next(b for b in batches if len(b) == 46)
for i in range(120):
    b = worst if mode == "fixed" else batches[i]
    ids, labels = tensors([corpus.train[j] for j in b], torch.device("cpu"))
    loss = step.model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    optimizer_step(step)
    if i % 20 == 0 or i == 119:
        print(mode, i, round(peak_data_bytes() / 2**20, 1), round(read_status_bytes("VmData") / 2**20, 1), flush=True)
