"""Accelerate: vramcal's helpers size a plain accelerate loop's batch from a profile, hold it to this process,
and print the run's measured peak against the prediction at the end.

    python examples/accelerate_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from tiny_lm import PARAMS, Tokens, parse_args, profile_path, tiny_lm

from vramcal.integrations.accelerate import measured, sized


def main() -> None:
    args = parse_args(__doc__)
    path = profile_path(args)  # the tiny model's profile: found under --profiles-dir, or calibrated there
    accelerator = Accelerator(cpu=True)
    model = tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # After prepare, before the DataLoader: sized() measures what this process holds against what the trials'
    # processes held (the process term) and sizes the batch with it (the conservative size; effective_batch_size=N
    # sets accelerator.gradient_accumulation_steps to reach N samples per step). module=: the model's blocks are
    # recomputed in the backward pass where the profile's variant checkpoints (--checkpointing), as its trials were.
    run = sized(accelerator, path, model="lm", params=PARAMS, module=model)
    loader = accelerator.prepare(torch.utils.data.DataLoader(Tokens(), batch_size=run.sizing.batch_size,
                                                             shuffle=True))
    # measured() watches this process's peak inside; at the end it prints it against the prediction (the main
    # process) and appends the run to the profile.
    with measured(run, accelerator) as steps:
        for batch in loader:  # (batch_size, seq_len) token ids and labels
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            steps.done += 1
            if steps.done == args.steps:
                break


if __name__ == "__main__":
    main()
