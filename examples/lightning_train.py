"""Lightning: a LightningModule as you have it, with vramcal's callback added: the first fit calibrates the module in
vramcal's isolated trial processes (its own training_step, optimizer, precision and data) and saves a verified
profile; every later fit reuses it with no trial. The callback sets the batch size, holds it to this process, and
prints the run's measured peak against the prediction at the end.

    python examples/lightning_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import lightning
import torch
from tiny_lm import Tokens, parse_args, tiny_lm

from vramcal.integrations.lightning import VramcalBatchSize


class LanguageModel(lightning.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()  # vramcal's trials rebuild the module from them: LanguageModel(**hparams)
        self.model = tiny_lm()
        self.batch_size = 1  # the attribute the callback sets (VramcalBatchSize(attr=...) names another)

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        return self.model(**batch).loss  # batch: (batch_size, seq_len) token ids and labels

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Built after the callback's on_fit_start, so it reads the size vramcal settled on.
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size, shuffle=True)


def main() -> None:
    args = parse_args(__doc__)
    # The one vramcal line. At setup("fit") the callback finds this module's profile under profiles_dir (or
    # calibrates it there: a line per trial) and sets batch_size to its conservative size; at on_fit_start it
    # measures what this process holds against what the trials' processes held (the process term) and lowers the
    # size if it no longer fits, saying why; an out-of-memory error in the fit is recorded in the profile and the fit
    # goes on at a smaller verified size; at on_fit_end it logs the peak against the prediction and records the run.
    callback = VramcalBatchSize(profiles_dir=args.profiles_dir, capacity_bytes=args.capacity)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=args.steps, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LanguageModel())


if __name__ == "__main__":
    main()
