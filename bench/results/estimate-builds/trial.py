"""One real host trial of the held-out model at the host estimate's safe size, as the held-out calibration ran its
trials (the same data options, steps and budget): python trial.py OUTDIR CAPACITY."""

import glob
import json
import sys

from vramcal.api import model_ref, select_devices, worker_pool
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.units import parse_bytes

out, capacity = sys.argv[1], sys.argv[2]
host = next(r for r in json.load(open(f"{out}/estimate.json"))["cards"] if r["card"].startswith("host: "))
(held,) = glob.glob(f"{out}/heldout/*/*.json")
options = json.load(open(held))["data"]["options"]  # the data file the calibration's trials held
device = select_devices("none", parse_bytes(capacity))[0][0]
ref = model_ref("regressor", {"d_model": 64, "n_layers": 2, "d_state": 16, "headdim": 16, "chunk_size": 32,
                              "seq_len": 64}, device=device, implementation="transformers")
request = TrialRequest(ref, host["safe_batch_size"], device, options_json=json.dumps(options),
                       usable_bytes=host["usable_bytes"])
(trial,) = TrialRunner(worker_pool()).run(request)
print(json.dumps({"batch_size": host["safe_batch_size"], "estimated_peak_bytes": host["peak_bytes"],
                  "options": options, "ok": trial.ok, "peak_bytes": trial.peak_bytes, "error": trial.error}))
