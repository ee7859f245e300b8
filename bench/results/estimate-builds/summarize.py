"""The table of bench/results/estimate-builds/README.md from run.sh's outputs: python summarize.py DIR [DIR ...]."""

import glob
import json
import sys

MIB = 2**20


def host(path):
    return next(r for r in json.load(open(path))["cards"] if r["card"].startswith("host: "))


for out in sys.argv[1:]:
    (held,) = glob.glob(f"{out}/heldout/*/*.json")
    profile = json.load(open(held))
    safe = profile["verification"]["safe"]
    before, at_safe = host(f"{out}/estimate.json"), host(f"{out}/estimate-at-measured-safe.json")
    bound = before["bound"]
    rows = [("measured safe", safe["batch_size"], at_safe["at_batch_size"]["peak_bytes"], safe["peak_bytes"])]
    trial = json.load(open(f"{out}/trial-at-estimated-safe.json"))
    rows.append(("estimated safe", trial["batch_size"], trial["estimated_peak_bytes"], trial["peak_bytes"]))
    print(f"{out}: torch {profile['software']['torch']}, baseline {before['baseline']['bytes'] / MIB:.1f} MiB "
          f"({before['baseline']['source']}); fit {profile['fit']}; bound: {bound['says']}")
    for name, batch, estimated, measured in rows:
        error = estimated / measured - 1
        print(f"| {profile['software']['torch']} | {name} {batch} | {estimated / MIB:.1f} | {measured / MIB:.1f} | "
              f"{error:+.2%} | {bound['low']:+.2%} to {bound['high']:+.2%} | "
              f"{'yes' if bound['low'] <= error <= bound['high'] else 'NO'} |")
