"""Lightning: vramcal's callback sets a LightningModule's batch size from a profile, holds it to this process,
and prints the run's measured peak against the prediction at the end.

    python examples/lightning_train.py [--steps 5] [--profiles-dir profiles] [--capacity 1.6GiB]
"""

from __future__ import annotations

import lightning
import torch
from tiny_lm import PARAMS, Tokens, parse_args, profile_path, tiny_lm

from vramcal.integrations.lightning import VramcalBatchSize


class LanguageModel(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_lm()
        self.batch_size = 1  # the attribute the callback sets (VramcalBatchSize(attr=...) names another)

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        return self.model(**batch).loss  # batch: (batch_size, seq_len) token ids and labels

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Built after the callback's on_fit_start, so it reads the size vramcal settled on.
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size, shuffle=True)


def main() -> None:
    args = parse_args(__doc__)
    path = profile_path(args)  # the tiny model's profile: found under --profiles-dir, or calibrated there
    # At setup("fit") the callback sets batch_size from the profile (the conservative size); at on_fit_start it
    # measures what this process holds against what the trials' processes held (the process term), adds the
    # gradients automatic optimization keeps through the forward pass, and lowers the size if it no longer fits.
    # At on_fit_end it logs this process's peak against the prediction and appends the run to the profile.
    callback = VramcalBatchSize(path, model="lm", params=PARAMS)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=args.steps, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LanguageModel())


if __name__ == "__main__":
    main()
