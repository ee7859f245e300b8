"""Hugging Face Trainer: vramcal's TrainerCallback fills per_device_train_batch_size from a profile, holds it to
the Trainer's process, and prints the run's measured peak against the prediction at the end.

    python examples/hf_trainer_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import tempfile

from tiny_lm import PARAMS, Tokens, parse_args, profile_path, tiny_lm
from transformers import Trainer, TrainingArguments

from vramcal.integrations.hf import VramcalCallback


def main() -> None:
    args = parse_args(__doc__)
    path = profile_path(args)  # the tiny model's profile: found under --profiles-dir, or calibrated there
    callback = VramcalCallback(path, model="lm", params=PARAMS)
    with tempfile.TemporaryDirectory() as output_dir:
        # sized() returns the arguments with per_device_train_batch_size from the profile (the conservative size;
        # sized(..., effective_batch_size=N) adds gradient_accumulation_steps to reach N samples per step).
        training = callback.sized(TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True))
        # At on_train_begin the callback measures what this process holds against what the trials' processes held
        # (the process term) and stops with one line if the batch no longer fits with it; at on_train_end it
        # prints this process's peak against the prediction and appends the run to the profile.
        Trainer(model=tiny_lm(), args=training, train_dataset=Tokens(), callbacks=[callback]).train()


if __name__ == "__main__":
    main()
