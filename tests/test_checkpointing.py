"""Activation checkpointing as a variant of one spec: real trials of the tiny model with and without it on the host,
its place in the profile's key, and its refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from host_budget import budget, capacity

from vramcal.api import worker_pool
from vramcal.calibration.fit import fit_linear
from vramcal.cli import main
from vramcal.measure.device import host_device
from vramcal.measure.trial import TrialRequest, TrialRunner
from vramcal.models.registry import model_ref
from vramcal.models.regressor.bars import synthetic_bars
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.profile import profile_path, save_profile
from vramcal.records import TrialSettings
from vramcal.sizing import SizeRequest, SizingError, variants
from vramcal.sizing.lookup import NoProfileError, locate_profile

from profiles_for_tests import build_profile

TINY = RegressorSpec(d_model=32, n_layers=2, d_state=16, headdim=16, seq_len=32, chunk_size=16)
BLOCK = dataclasses.replace(TINY, checkpointing="block")
SIZES = (64, 512, 1024)  # ~0.1-0.2 MiB a sample: the largest trial holds ~150 MiB of activations without it


@pytest.fixture(scope="module")
def measured():
    """Real trials of both variants at three batch sizes each (about 15 s): the host, 4 GiB, no fakes."""
    runner, device = TrialRunner(worker_pool()), host_device(budget(4 * 2**30))
    settings = TrialSettings(timeout_s=120)
    trials = {spec.checkpointing: [runner.run(TrialRequest(spec.ref("transformers"), size, device,
                                                           settings=settings))[0] for size in SIZES]
              for spec in (TINY, BLOCK)}
    return device, trials


def test_a_checkpointed_step_holds_less_per_sample(measured):
    _, trials = measured
    assert all(t.ok for each in trials.values() for t in each), trials
    off, block = (fit_linear(SIZES, [t.peak_bytes for t in trials[name]]).slope_bytes_per_sample
                  for name in ("off", "block"))
    # each of the 2 blocks keeps only its input in the forward pass, one block's activations live at a time in the
    # backward pass: measured 0.5-0.6 of the slope without
    assert block < 0.8 * off, (block, off)
    # the same weights and optimizer: what a checkpointed step saves is activations, not the overhead
    assert abs(trials["block"][0].peak_bytes - trials["off"][0].peak_bytes) < 0.1 * trials["off"][0].peak_bytes


def test_the_variant_is_in_the_profile_key_and_the_lookup_never_sizes_one_by_the_other(measured, tmp_path):
    device, trials = measured
    profile = build_profile(device, trials["block"], spec=BLOCK)
    off_ref = TINY.ref("transformers")
    assert profile.model.params["checkpointing"] == "block" and profile.model.key() != off_ref.key()
    assert "checkpointing" not in off_ref.params  # off: the key profiles made before the setting have
    assert RegressorSpec.from_ref(profile.model) == (BLOCK, "transformers")
    with pytest.raises(SizingError, match=r"another model: checkpointing=off \(the profile's: block\)"):
        locate_profile("regressor", TINY.to_dict(), device=device, profile=profile, implementation="transformers")

    save_profile(profile, profile_path(tmp_path, device, profile.model, "transformers"))
    found = locate_profile("regressor", BLOCK.to_dict(), device=device, profiles_dir=tmp_path,
                           implementation="transformers")
    assert found.profile.model == profile.model
    with pytest.raises(NoProfileError) as missing:
        locate_profile("regressor", TINY.to_dict(), device=device, profiles_dir=tmp_path, implementation="transformers")
    assert "--checkpointing" not in missing.value.command
    with pytest.raises(NoProfileError) as other:
        locate_profile("regressor", {**TINY.to_dict(), "checkpointing": "every:2"}, device=device,
                       profiles_dir=tmp_path, implementation="transformers")
    assert "--checkpointing every:2" in other.value.command and "--n-layers 2" in other.value.command


def error_lines(*args: str) -> list[str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    return [line for line in result.output.splitlines() if line.startswith("Error")]


@pytest.mark.parametrize("command", ["probe", "train"])
def test_a_bad_checkpointing_value_is_one_line_exit_2(command):
    assert error_lines(command, "--gpu", "none", "--checkpointing", "blocks") == [
        "Error: Invalid value for '--checkpointing': must be off, block or every:K (every K-th block, K a whole "
        "number), got 'blocks'"]
    assert error_lines(command, "--gpu", "none", "--checkpointing", "every:1") == [
        "Error: Invalid value for '--checkpointing': every:1 is every block: write block"]


def test_every_k_past_the_layers_is_refused_in_one_line():
    (line,) = error_lines("probe", "--gpu", "none", "--n-layers", "2", "--checkpointing", "every:3")
    assert line.endswith("checkpointing every:3 is more than n_layers 2: use every:2 or block"), line
    with pytest.raises(ValueError, match="^checkpointing every:5 is more than n_layers 4: use every:2 to every:4, "
                                         "or block$"):
        RegressorSpec(checkpointing="every:5")
    assert RegressorSpec(checkpointing="every:4").checkpoint_stride == 4


def test_the_language_model_takes_it_as_a_model_arg():
    device, config = host_device(), "configs/mamba2-lm-tiny.json"
    plain = model_ref("lm", {"config": config, "seq_len": 32, "checkpointing": "off"}, device=device)
    block = model_ref("lm", {"config": config, "seq_len": 32, "checkpointing": "block"}, device=device)
    assert "checkpointing" not in plain.params and block.params["checkpointing"] == "block"
    with pytest.raises(ValueError, match="checkpointing every:3 is more than num_hidden_layers 2"):
        model_ref("lm", {"config": config, "seq_len": 32, "checkpointing": "every:3"}, device=device)


# ------------------------------------------------------------------------------------------- the choice (variants)

@pytest.fixture(scope="module")
def variant_folder(measured, tmp_path_factory):
    """Both variants' profiles (real trials, verified as build_profile verifies) in one profiles folder."""
    device, trials = measured
    folder = tmp_path_factory.mktemp("variants")
    profiles = {}
    for spec in (TINY, BLOCK):
        profile = build_profile(device, trials[spec.checkpointing], spec=spec)
        save_profile(profile, profile_path(folder / "profiles", device, profile.model, "transformers"))
        profiles[spec.checkpointing] = profile
    return device, folder, profiles


def test_the_variants_are_found_together_and_tabulated(variant_folder):
    device, folder, profiles = variant_folder
    found = variants.variants_of(TINY.ref("transformers"), device, folder / "profiles",
                                 total_bytes=device.total_bytes)
    rows = {row.label: row for row in variants.variant_rows(found)}
    assert set(rows) == {"checkpointing off, chunk_size 16", "checkpointing block, chunk_size 16"}
    off, block = rows["checkpointing off, chunk_size 16"], rows["checkpointing block, chunk_size 16"]
    assert block.profile.limits.safe_batch_size > off.profile.limits.safe_batch_size
    assert off.rate_conservative is not None and off.samples_per_s_per_gib > 0  # measured near the limit
    assert variants.variants_of(TINY.ref("transformers"), device, folder / "profiles", total_bytes=2**30) == []
    shown = CliRunner().invoke(main, ["show", str(off.path)])
    assert shown.exit_code == 0 and "variants of this model (2, each its own profile" in shown.output, shown.output
    table = shown.output.split("variants of this model")[1]
    assert "checkpointing block, chunk_size 16" in table and "checkpointing off, chunk_size 16" in table


def test_the_report_draws_the_frontier_and_carries_the_variants_in_markdown_and_json(variant_folder, tmp_path):
    device, folder, profiles = variant_folder
    result = CliRunner().invoke(main, ["report", str(folder / "profiles"), "--out", str(tmp_path), "--name", "both",
                                       "--json"])
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)
    (group,) = said["variants"]
    assert group["png"] == str(tmp_path / "both-variants.png")
    assert Path(group["png"]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    rows = {row["variant"]: row for row in group["rows"]}
    assert set(rows) == {"checkpointing off, chunk_size 16", "checkpointing block, chunk_size 16"}
    for name, profile in profiles.items():
        row = rows[f"checkpointing {name}, chunk_size 16"]
        assert row["safe_batch_size"] == profile.limits.safe_batch_size and row["verified"] is True
        assert Path(row["path"]).is_file() and row["samples_per_s_conservative"] > 0
    markdown = (tmp_path / "both.md").read_text()
    section = markdown.split("## Variants of this model")[1]
    assert "![Samples/s against batch size, one line per variant](both-variants.png)" in section
    cells = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
             for line in section.splitlines() if line.startswith("| checkpointing")}
    for name, profile in profiles.items():  # variant | verified | safe | conservative | ...
        assert cells[f"checkpointing {name}, chunk_size 16"][:3] == [
            "yes", str(profile.limits.safe_batch_size), str(profile.limits.conservative_batch_size)], cells
    alone = CliRunner().invoke(main, ["report", str(rows["checkpointing off, chunk_size 16"]["path"]), "--out",
                                      str(tmp_path / "one"), "--json"])
    assert alone.exit_code == 0 and json.loads(alone.stdout)["variants"] == [], alone.output
    assert not list((tmp_path / "one").glob("*variants*")) and "Variants" not in Path(
        json.loads(alone.stdout)["markdown"]).read_text()


def test_the_choice_takes_a_variant_that_admits_the_request_and_is_never_from_noise(variant_folder):
    device, folder, profiles = variant_folder
    found = variants.variants_of(TINY.ref("transformers"), device, folder / "profiles")
    off_safe = profiles["off"].limits.safe_batch_size
    named = TINY.ref("transformers")

    above = variants.choose(found, SizeRequest(request=off_safe + 1), named)  # only checkpointing fits it
    assert above.chosen.profile.model.params["checkpointing"] == "block"
    assert above.chosen.sizing.batch_size == off_safe + 1 and len(above.candidates) == 1
    assert above.passed_over == (f"checkpointing off, chunk_size 16: batch_size {off_safe + 1} is above its safe "
                                 f"batch size {off_safe}",)

    block_conservative = profiles["block"].limits.conservative_batch_size  # above off's safe size (slope < 0.8x)
    effective = variants.choose(found, SizeRequest(effective_batch_size=block_conservative), named)
    sized = {c.profile.model.params.get("checkpointing", "off"): c.sizing for c in effective.candidates}
    assert sized["off"].accumulation_steps >= 2 > sized["block"].accumulation_steps  # accumulation against memory
    for choice in (effective, variants.choose(found, SizeRequest(), named)):
        own = next(c for c in choice.candidates if c.profile.model == named)
        if choice.chosen is not own:  # another variant only when measurably faster
            assert choice.chosen.rate.low_samples_per_s > own.rate.high_samples_per_s, choice.reason
        else:
            assert choice.reason.startswith("the variant named")

    # a batch both train alike: checkpointing only adds the recomputation, whatever the calibration's rates say
    alike = variants.choose(found, SizeRequest(request=off_safe), BLOCK.ref("transformers"))
    assert alike.chosen.profile.model == named and [c.profile.model for c in alike.candidates] == [named]
    assert alike.passed_over == (f"checkpointing block, chunk_size 16: trains batch_size {off_safe} as "
                                 f"checkpointing off, chunk_size 16 does, recomputing its blocks",)

    unverified = [(path, dataclasses.replace(profile, verification={})) for path, profile in found]
    with pytest.raises(SizingError, match="no calibrated variant can train this run: .*not verified"):
        variants.choose(unverified, SizeRequest(), named)


def test_train_variant_auto_trains_the_variant_chosen(variant_folder):
    device, folder, profiles = variant_folder
    synthetic_bars(400).to_parquet(folder / "bars.parquet")
    batch = profiles["off"].limits.safe_batch_size + 1
    args = ["train", "--data", str(folder / "bars.parquet"), "--profiles-dir", str(folder / "profiles"), "--gpu",
            "none", "--capacity", str(device.total_bytes), "--d-model", "32", "--n-layers", "2", "--d-state", "16",
            "--headdim", "16", "--seq-len", "32", "--chunk-size", "16", "--max-steps", "1", "--batch-size",
            str(batch), "--variant", "auto", "--report-to", "none"]
    result = CliRunner().invoke(main, [*args, "--run-dir", str(folder / "run")])
    assert result.exit_code == 0, result.output
    assert "--variant auto, of 2 calibrated: the fastest measured: checkpointing block" in result.stderr
    assert "training: d_model=32 n_layers=2" in result.stderr and "checkpointing=block" in result.stderr
    saved = json.loads((folder / "run" / "config.json").read_text())
    assert saved["spec"]["checkpointing"] == "block" and saved["variant"] == "auto"
    assert json.loads((folder / "run" / "run.json").read_text())["model"]["params"]["checkpointing"] == "block"
    spec_run = CliRunner().invoke(main, [*args[:-4], "--run-dir", str(folder / "spec")])  # the spec as given
    assert spec_run.exit_code == 0 and "checkpointing=block" not in spec_run.stderr, spec_run.output


def test_a_variant_asked_of_a_factory_that_cannot_take_it_is_one_line_before_any_trial(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(3 * 2**29), "--model",
                                       "user_models:mlp", "--model-arg", "checkpointing=block"])
    assert result.exit_code == 1 and "Traceback" not in result.output and "batch_size" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert "the factory user_models:mlp takes no 'checkpointing' (activation checkpointing is the factory's" in line
