"""Plain PyTorch: vramcal's FrameworkRun sizes a hand-written loop's batch from a profile, holds it to this
process, and gives the run's measured peak against the prediction at the end.

    python examples/plain_pytorch_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import torch
from tiny_lm import PARAMS, Tokens, parse_args, profile_path, tiny_lm

from vramcal.integrations.run import FrameworkRun


def main() -> None:
    args = parse_args(__doc__)
    path = profile_path(args)  # the tiny model's profile: found under --profiles-dir, or calibrated there
    device = torch.device("cpu")
    run = FrameworkRun(path, model="lm", params=PARAMS, device=device)  # reads and checks the profile
    model = tiny_lm().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.checkpoint(model)  # the blocks recomputed in the backward pass as the profile's trials were (its variant)
    # Training starts (the model and the optimizer are on the device): start() measures what this process holds
    # against what the trials' processes held (the process term), sizes the batch with it (the conservative size)
    # and starts watching this process's peak.
    batch_size = run.start().batch_size
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=batch_size, shuffle=True)
    for _, batch in zip(range(args.steps), loader):  # (batch_size, seq_len) token ids and labels
        model(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # finish(): this process's peak against the prediction (one line, and warnings), the run appended to the profile.
    line, warnings = run.finish(steps=args.steps)
    print(line, *warnings, sep="\n")


if __name__ == "__main__":
    main()
