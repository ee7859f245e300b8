"""A checkpointed variant's profile applied to the user's own model by the integrations (issue 45 item 3): a real
Lightning fit, a real HF Trainer run, an Accelerate loop and a plain loop of a tiny Mamba-2 language model, each
recomputing exactly the blocks the profile's trials did, counted where transformers recomputes them; and the one-line
refusal of a model with no blocks to checkpoint."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from test_integrations import Tokens, tiny_lm
from test_lightning import Regressor, profile_here

from vramcal.models.mamba2 import checkpoint_model
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import save_profile
from vramcal.sizing import SizingError

from profiles_for_tests import build_profile


def variant_profile(tmp_path, checkpointing: str):
    """profile_here's figures, made by trials of the variant ``checkpointing`` (the tiny lm has 2 blocks)."""
    base = profile_here()
    spec = RegressorSpec(n_layers=2, checkpointing=checkpointing)
    profile = build_profile(base.device, [t for t in base.trials if t.purpose == "grow"], spec=spec)
    return save_profile(profile, tmp_path / f"{checkpointing}.json")


def count_mixer_calls(model) -> list[int]:
    """Each block's mixer forward calls, counted as they happen: a recomputed block's mixer runs twice a step
    (the forward pass and its replay in the backward pass), another's once. Counted in its ``forward`` (torch's
    replay calls no module hooks)."""
    calls = [0] * len(model.backbone.layers)
    for index, layer in enumerate(model.backbone.layers):
        def counted(*args, forward=layer.mixer.forward, index=index, **kwargs):
            calls[index] += 1
            return forward(*args, **kwargs)

        layer.mixer.forward = counted
    return calls


class LanguageModel(LightningModule):
    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        self.batch_size, self.lm = batch_size, tiny_lm()
        self.calls = count_mixer_calls(self.lm)

    def training_step(self, batch, index):
        return self.lm(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)


def fit(module, callback, tmp_path, steps: int = 2) -> None:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tmp_path, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|log_every_n_steps|treespec).*")
        trainer.fit(module)


def test_lightning_recomputes_the_blocks_the_profile_says(tmp_path):
    """every:2 of 2 blocks: block 0 replayed in each backward pass, block 1 not; 2 steps."""
    from vramcal.integrations.lightning import VramcalBatchSize

    callback, module = VramcalBatchSize(variant_profile(tmp_path, "every:2"), request=4), LanguageModel()
    fit(module, callback, tmp_path)
    assert module.calls == [4, 2], module.calls
    assert callback.run.checkpointed == (1, 2) and callback.report.startswith("vramcal: peak ")


def test_lightning_refuses_a_module_with_no_blocks_in_one_line(tmp_path):
    from vramcal.integrations.lightning import VramcalBatchSize

    module = Regressor()
    with pytest.raises(SizingError) as refused:
        fit(module, VramcalBatchSize(variant_profile(tmp_path, "block")), tmp_path)
    line = str(refused.value)
    assert "\n" not in line and "checkpointing block" in line and "(Regressor) has no Mamba-2 blocks" in line
    assert "calibrated with checkpointing off" in line
    assert module.calls == 0  # refused before any step


def test_hf_trainer_recomputes_every_block_whatever_its_arguments_say(tmp_path):
    """The profile checkpoints each block; the arguments ask for none: each block's mixer runs twice a step, 2 steps."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    from vramcal.integrations.hf import VramcalCallback

    callback, model = VramcalCallback(variant_profile(tmp_path, "block"), request=4), tiny_lm()
    calls = count_mixer_calls(model)
    args = callback.sized(TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, use_cpu=True,
                                            report_to=[], save_strategy="no", logging_strategy="no",
                                            disable_tqdm=True))
    assert not args.activation_checkpointing and args.per_device_train_batch_size == 4
    trainer = HFTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert calls == [4, 4], calls
    assert callback.run.checkpointed == (2, 2)


def test_hf_trainer_refuses_a_model_with_no_blocks(tmp_path):
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments
    from user_models import MLP

    from vramcal.integrations.hf import VramcalCallback

    class Wrapped(torch.nn.Module):  # the Trainer's contract: a loss from keyword batches
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(32, 8)

        def forward(self, input_ids, labels):
            return {"loss": self.mlp(input_ids.float()).mean()}

    callback = VramcalCallback(variant_profile(tmp_path, "every:2"))
    args = callback.sized(TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, use_cpu=True,
                                            report_to=[], save_strategy="no", disable_tqdm=True))
    trainer = HFTrainer(model=Wrapped(), args=args, train_dataset=Tokens(), callbacks=[callback])
    with pytest.raises(SizingError, match=r"^\S+every:2\.json was calibrated with checkpointing every:2, and the "
                                          r"model \(Wrapped\) has no Mamba-2 blocks"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_accelerate_checkpoints_the_prepared_model(tmp_path):
    from accelerate import Accelerator

    from vramcal.integrations.accelerate import sized

    path = variant_profile(tmp_path, "block")
    accelerator = Accelerator(cpu=True)
    model = tiny_lm()
    calls = count_mixer_calls(model)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = sized(accelerator, path, module=model)
    batch = next(iter(torch.utils.data.DataLoader(Tokens(), batch_size=4)))
    accelerator.backward(model(**batch).loss)
    assert calls == [2, 2] and run.checkpointed == (2, 2)
    with pytest.raises(TypeError, match="module= takes the torch.nn.Module this process trains"):
        sized(accelerator, path, module="model")


def test_a_plain_loop_checkpoints_its_model_or_is_warned(tmp_path):
    """The plain loop calls run.checkpoint(model); a run started without it is warned, and a model that
    recomputes blocks under a profile that did not is warned too (it holds less, and is slower, than its figures)."""
    from vramcal.integrations.run import FrameworkRun

    block, off = variant_profile(tmp_path, "block"), save_profile(profile_here(), tmp_path / "off.json")
    with pytest.warns(UserWarning, match=r"block\.json was calibrated with checkpointing block: call "
                                         r"checkpoint\(model\) before start\(\)"):
        FrameworkRun(block, device="cpu").start()
    run, model = FrameworkRun(block, device="cpu"), tiny_lm()
    said = run.checkpoint(model)
    assert said.startswith("vramcal: checkpointing block: 2 of 2 blocks recomputed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning now
        run.start()
    run.close()
    with pytest.warns(UserWarning, match="recomputes 2 of 2 blocks in the backward pass and .*off.json was "
                                         "calibrated without checkpointing"):
        FrameworkRun(off, device="cpu").checkpoint(model)
    assert FrameworkRun(off, device="cpu").checkpoint(tiny_lm()) is None  # neither checkpoints: nothing said


def test_the_model_is_checkpointed_as_the_trials_were():
    """The regressor a trial of a variant builds against a user's copy checkpointed afterwards: the same blocks
    recomputed, for each variant and both backbones' bookkeeping."""
    from vramcal.models.regressor.step import build_model

    for checkpointing, expected in (("block", (4, 4)), ("every:2", (2, 4)), ("every:3", (2, 4)), ("off", (0, 4))):
        spec = RegressorSpec(d_model=32, n_layers=4, d_state=16, headdim=16, seq_len=32, chunk_size=16)
        trial = build_model(dataclasses.replace(spec, checkpointing=checkpointing), "transformers")
        assert checkpoint_model(trial, 0) == expected, checkpointing  # 0 reads, changes nothing
        user = build_model(spec, "transformers")
        every = {"block": 1, "every:2": 2, "every:3": 3, "off": 0}[checkpointing]
        assert checkpoint_model(user, every) == expected
        flags = [layer.gradient_checkpointing for layer in user.backbone.model.layers]
        assert flags == [layer.gradient_checkpointing for layer in trial.backbone.model.layers]
