"""Hugging Face Trainer: a Trainer as you have it, with vramcal's callback added: the first train() calibrates the
model in vramcal's isolated trial processes (its class and config, the optimizer and mixed precision of the
TrainingArguments, batches from the Trainer's own data collator) and saves a verified profile; every later run reuses
it with no trial. The callback sets per_device_train_batch_size and gradient_accumulation_steps, holds them to this
process, and prints the run's measured peak against the prediction at the end.

    python examples/hf_trainer_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import tempfile

from tiny_lm import Tokens, parse_args, tiny_lm
from transformers import Trainer, TrainingArguments

from vramcal.integrations.hf import VramcalCallback


def main() -> None:
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, max_steps=args.steps, use_cpu=True, report_to=[],
                                     save_strategy="no", logging_strategy="no", disable_tqdm=True)
        # The one vramcal line. When train() starts, the callback finds the model's profile under profiles_dir (or
        # calibrates it there: a line per trial) and sets the batch size; at on_train_begin it measures what this
        # process holds against what the trials' processes held (the process term) and starts the training loop
        # again at a smaller size if it no longer fits, as after an out-of-memory error (recorded in the profile);
        # at on_train_end it prints this process's peak against the prediction and records the run.
        callback = VramcalCallback(profiles_dir=args.profiles_dir, capacity_bytes=args.capacity)
        Trainer(model=tiny_lm(), args=training, train_dataset=Tokens(), callbacks=[callback]).train()


if __name__ == "__main__":
    main()
