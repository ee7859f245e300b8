"""Reports: real PNGs and Markdown from profiles, the other-GPU catalogue arithmetic, the two commands."""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vramcal.cli import main
from vramcal.profile import load_profile, profile_path, save_profile
from vramcal.records import Trial, World
from vramcal.report import write_report
from vramcal.report.catalogue import CATALOGUE, GpuModel, other_gpu_limits, parse_gpu_list
from vramcal.report.figure import DPI, FIGSIZE_IN
from vramcal.report.markdown import render_markdown, report_name, series_labels
from vramcal.units import format_bytes

from profiles_for_tests import GIB, build_profile, gpu_device, gpu_profile, gpu_trial, host_profile, sparse_profile

MIB = 2**20
REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "examples" / "measured"  # the project's own measured profiles and reports, not a user's profiles/


def png_dimensions(data: bytes) -> tuple[int, int]:
    """Width and height from the IHDR chunk; fails unless ``data`` starts like a PNG file."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def exact_profile(failed_at: int | None = None):
    """Points exactly on peak = 0.5 GiB + 0.125 GiB x batch (binary-exact numbers) on a 12 GiB card."""
    trials = [gpu_trial(b, 2**29 + 2**27 * b) for b in (1, 2, 4, 8)]
    if failed_at is not None:
        trials.append(Trial(batch_size=failed_at, status="oom", purpose="grow"))
    return build_profile(gpu_device(total_bytes=12 * GIB), trials)


# ---------------------------------------------------------------------------------------------- catalogue

def test_catalogue_has_the_cards_the_issue_names_with_nvidia_smi_totals():
    totals_mib = {gpu.label: gpu.total_bytes // MIB for gpu in CATALOGUE}
    assert totals_mib == {"RTX 3050 Ti Laptop 4 GB": 4096, "RTX 3060 12 GB": 12288, "RTX A4000 16 GB": 16376,
                          "RTX 4090 24 GB": 24564, "A100 40 GB (SXM4)": 40960, "A100 80 GB (SXM4)": 81920,
                          "H100 80 GB (HBM3)": 81559, "H200 141 GB": 143771}
    assert all(gpu.source == f"nvidia-smi total {gpu.total_bytes // MIB} MiB" for gpu in CATALOGUE)


def test_catalogue_arithmetic_matches_hand_worked_values():
    profile = exact_profile()
    rows = {row.gpu.label: row for row in other_gpu_limits(profile, [GpuModel("card 16 GiB", 16 * GIB, "test")])}
    # 16 GiB: usable = 17179869184 - 536870912 - 1717986918.4 = 14925011353.6 B -> 14925011353 (13.9 GiB);
    # safe = floor((13.9 - 0.5) / 0.125) = floor(107.2) = 107; conservative = floor(0.9 x 107) = floor(96.3) = 96.
    card = rows["card 16 GiB"].limits
    assert (card.usable_bytes, card.safe_batch_size, card.conservative_batch_size) == (14925011353, 107, 96)
    # RTX 3050 Ti, 4096 MiB: usable = 4096 - 512 - 409.6 = 3174.4 MiB; (3174.4 - 512) / 128 = 20.8 -> 20; 18.
    small = rows["RTX 3050 Ti Laptop 4 GB"].limits
    assert (small.usable_bytes, small.safe_batch_size, small.conservative_batch_size) == (3328599654, 20, 18)
    # H200, 143771 MiB: usable = 143771 - 512 - 14377.1 = 128881.9 MiB;
    # (128881.9 - 512) / 128 = 1002.9 -> 1002; floor(0.9 x 1002) = floor(901.8) = 901.
    big = rows["H200 141 GB"].limits
    assert (big.safe_batch_size, big.conservative_batch_size) == (1002, 901)
    assert big.usable_bytes == int(143771 * MIB * 0.9 - 512 * MIB)
    # The measured card (12 GiB here) keeps the profile's own limits: (12 - 0.5 - 1.2 - 0.5) / 0.125 = 78.4 -> 78.
    measured = [row for row in rows.values() if row.measured]
    assert len(measured) == 1 and measured[0].limits == profile.limits and profile.limits.safe_batch_size == 78


def test_rows_are_sorted_by_memory_and_the_measured_card_replaces_its_catalogue_entry():
    rows = other_gpu_limits(gpu_profile())  # an RTX 3060: the catalogue's RTX 3060 row gives way to it
    assert [r.gpu.total_bytes for r in rows] == sorted(r.gpu.total_bytes for r in rows)
    assert sum(r.measured for r in rows) == 1 and len(rows) == len(CATALOGUE)
    assert "RTX 3060 12 GB" not in [r.gpu.label for r in rows]


def test_a_failed_batch_caps_cards_with_no_more_memory_only():
    rows = {row.gpu.label: row.limits for row in other_gpu_limits(exact_profile(failed_at=10))}
    assert rows["RTX 3050 Ti Laptop 4 GB"].safe_batch_size == 9  # 20 by the fit, capped below 10
    assert rows["RTX A4000 16 GB"].safe_batch_size > 100  # a bigger card: the failure says nothing


def test_no_fit_means_no_extrapolation():
    with pytest.raises(ValueError, match="at least 3 successful trials"):
        other_gpu_limits(sparse_profile())


def test_parse_gpu_list():
    gpus = parse_gpu_list("RTX 4080=16GiB, L4 = 24GB,")
    assert [(g.label, g.total_bytes) for g in gpus] == [("RTX 4080", 16 * GIB), ("L4", 24 * 10**9)]
    for bad in ("RTX 4080", "=16GiB", "RTX 4080=sixteen"):
        with pytest.raises(ValueError, match="--gpus entry"):
            parse_gpu_list(bad)


@pytest.mark.parametrize(("gpus", "phrase"), [
    ("Z=24", "'Z=24': 24 is below the minimum of 1.00 MiB"),
    ("X=0", "'X=0': 0 is below the minimum of 1.00 MiB"),
    ("A=12GiB,a=16GiB", "'a' is given twice"),
])
def test_limits_refuses_tiny_sizes_and_duplicate_names_with_exit_2(tmp_path, gpus, phrase):
    path = save_profile(gpu_profile(), tmp_path / "gpu.json")
    result = CliRunner().invoke(main, ["limits", str(path), "--gpus", gpus])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert phrase in result.output
    assert parse_gpu_list("A=1MiB")[0].total_bytes == 2**20  # the minimum itself is a card


# ---------------------------------------------------------------------------------------------- reports

def test_report_of_a_gpu_profile_has_a_real_png_and_the_computed_numbers(tmp_path):
    profile = gpu_profile()
    png, markdown = write_report([profile], tmp_path)
    assert png.name == f"{report_name([profile])}.png" and markdown.suffix == ".md"
    data = png.read_bytes()
    assert png_dimensions(data) == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
    assert 30_000 < len(data) < 1_500_000
    text = markdown.read_text()
    limits, fit = profile.limits, profile.fit
    assert f"![Peak memory and throughput against batch size]({png.name})" in text
    assert f"`{fit.formula()}`" in text and f"r² = {fit.r_squared:.4f}" in text
    assert f"**{limits.safe_batch_size}**" in text and f"**{limits.conservative_batch_size}**" in text
    assert format_bytes(limits.usable_bytes) in text
    assert "safe batch 119: passed" in text and "conservative batch 107: passed" in text
    for trial in profile.trials:
        assert f"| {trial.batch_size:>5} |" in text
    assert "| over-budget |" in text and "| oom " in text
    rtx4090 = next(r for r in other_gpu_limits(profile) if r.gpu.label == "RTX 4090 24 GB").limits
    assert "| RTX 4090 24 GB " in text
    assert f"| {rtx4090.safe_batch_size:>8} | {rtx4090.conservative_batch_size:>12} |" in text
    assert "**measured** (verified)" in text and "extrapolations" in text and "CUDA context" in text


def test_reports_are_deterministic_and_survive_a_round_trip_through_the_profile_file(tmp_path):
    profile = gpu_profile()
    first = write_report([profile], tmp_path / "a")
    path = save_profile(profile, tmp_path / "p.json")
    second = write_report([load_profile(path)], tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def test_a_profile_without_a_fit_says_what_is_missing(tmp_path):
    png, markdown = write_report([sparse_profile()], tmp_path, name="sparse")
    assert png_dimensions(png.read_bytes())[0] == int(FIGSIZE_IN[0] * DPI)
    text = markdown.read_text()
    assert "> **No fit**: 2 successful trial(s)" in text
    assert "**Memory model**            | **none**" in text and "**Safe batch size**         | **none**" in text
    assert "Not available: there is no fit to extrapolate from." in text
    assert "| timeout |" in text and "in fit" not in text.split("## Trials")[1].split("\n")[4]


def test_an_unverified_profile_is_not_presented_as_limits(tmp_path):
    text = write_report([gpu_profile(verify=False)], tmp_path)[1].read_text()
    assert "> **Not verified (no verification trial ran)**: the batch sizes below are extrapolations" in text
    assert "(**not verified**: extrapolation only)" in text and "measured** (NOT verified)" in text


def test_a_host_profile_drops_absent_sources_and_is_not_carried_to_gpus(tmp_path):
    text = write_report([host_profile()], tmp_path)[1].read_text()
    assert "host RAM: AMD EPYC 7763 (2 cores) (8.00 GiB)" in text
    assert "RSS peak" in text and "NVML peak" not in text
    gpus = text.partition("Limits on other GPUs (not carried)")[2]
    assert "H200" not in gpus.partition("- A host profile")[0] and "extrapolated;" not in gpus
    assert "A host profile is not carried to GPUs" in gpus and "`vramcal estimate " in gpus


def test_several_profiles_share_one_figure_and_a_comparison_table(tmp_path):
    profiles = [gpu_profile(), host_profile()]
    png, markdown = write_report(profiles, tmp_path)
    assert png.name.startswith("compare-") and png_dimensions(png.read_bytes())
    text = markdown.read_text()
    assert "## Comparison" in text and text.count("### Trials") == 2
    assert "## NVIDIA GeForce RTX 3060 (12.00 GiB)" in text and "## host RAM: AMD EPYC 7763" in text
    assert render_markdown(profiles, png.name) == text


def test_profiles_of_two_families_are_told_apart_by_family_and_shape_not_by_settings_the_other_lacks(tmp_path):
    """The comparison's labels name what differs: the family where families differ, a config by its shape, and
    never a setting one family lacks as ``d_model=None`` nor a config's whole dict (the table was unreadable)."""
    from vramcal.workload import ModelRef

    regressor = host_profile()
    lm = dataclasses.replace(regressor, model=ModelRef.make("vramcal.models.lm:training_step", {
        "config": {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 8192, "state_size": 32}, "seq_len": 64}))
    wider = dataclasses.replace(regressor, model=ModelRef.make(regressor.model.factory, {
        **regressor.model.params, "d_model": 2 * regressor.model.params["d_model"]}))
    labels, title = series_labels([regressor, lm, wider])
    d_model, seq_len = regressor.model.params["d_model"], regressor.model.params["seq_len"]  # the device: shared
    assert labels == [f"regressor · d_model={d_model} seq_len={seq_len}", "lm · seq_len=64",
                      f"regressor · d_model={2 * d_model} seq_len={seq_len}"]
    assert title[1] == "models differ (see legend)"
    labels, _ = series_labels([regressor, wider])  # one family: not named; only d_model differs
    assert labels == [f"d_model={d_model}", f"d_model={2 * d_model}"]


def test_reports_of_two_host_budgets_and_of_ddp_do_not_overwrite_each_other(tmp_path):
    """The report's name follows the profile file's (budget and DDP world included): two ``--capacity``
    calibrations of one host, and a DDP one, each keep their report."""
    base = host_profile()
    budgets = [dataclasses.replace(base, device=dataclasses.replace(base.device, total_bytes=total,
                                                                   total_source="--capacity"))
               for total in (5 * GIB // 2, 4 * GIB)]
    ddp = dataclasses.replace(budgets[0], world=World(2))
    names = [report_name([p]) for p in (*budgets, ddp)]
    assert names[0].endswith("-2.5gib") and names[1].endswith("-4gib") and "-ddp2" in names[2]
    for profile, name in zip((*budgets, ddp), names):
        assert name == f"{profile.device.slug()}-" + profile_path(tmp_path, profile.device, profile.model,
                                                                   profile.implementation, world=profile.world).stem
    written = [write_report([p], tmp_path)[1] for p in (*budgets, ddp)]
    assert len({path.name for path in written}) == 3 and all(path.exists() for path in written)


def test_the_figure_draws_the_boundary_the_band_it_states_and_the_warning_line():
    """Issue 42 item 6: the predicted out-of-memory boundary is drawn (a vertical line where the line reaches total
    memory), the key states the 95 % band's width (thinner than the line with points on a line) and names the
    warning line a run is held against, which is drawn; a size above safe is hollow and "best" says it stops at
    safe, naming a faster one above it."""
    from vramcal.report.figure import build_figure

    profile = gpu_profile()
    figure = build_figure([profile])
    memory, speed = figure.axes[:2]
    (boundary,) = [line for line in memory.get_lines() if line.get_gid() == "oom-boundary"]
    assert boundary.get_xdata()[0] == pytest.approx(profile.limits.boundary_batch_size)
    assert profile.fit.predict(profile.limits.boundary_batch_size) == pytest.approx(profile.device.total_bytes)
    assert memory.get_xlim()[1] > profile.limits.boundary_batch_size
    labels = [text.get_text() for text in memory.get_legend().get_texts()]
    assert any(label.startswith(f"out-of-memory boundary ≈ {profile.limits.boundary_batch_size:,.0f}")
               for label in labels), labels
    half = profile.fit.half_width(profile.limits.safe_batch_size)
    assert any(f"95 % prediction band ±{format_bytes(half)} at {profile.limits.safe_batch_size}" in label
               for label in labels), labels
    (warning,) = [line for line in memory.get_lines() if line.get_gid() == "warning-line"]
    at = profile.limits.safe_batch_size
    drawn = float(np.interp(at, warning.get_xdata(), warning.get_ydata())) * GIB
    assert drawn == pytest.approx(max(profile.fit.upper(at), profile.fit.predict(at) * 1.03), rel=2e-3)
    assert any(label.startswith("warning line: prediction +3.0 %") or label.startswith("warning line: prediction "
               "+3.0%") for label in labels), labels
    hollow = [c for c in speed.collections if c.get_gid() == "above-safe"]
    assert hollow and all(x > profile.limits.safe_batch_size for x, _ in hollow[0].get_offsets())
    speed_labels = " ".join(t.get_text() for t in speed.get_legend().get_texts())
    assert "best (up to safe)" in speed_labels and "above the safe size" in speed_labels


def test_a_ddp_figure_says_per_rank_and_its_world():
    from vramcal.report.figure import build_figure

    ddp = dataclasses.replace(host_profile(), world=World(2))
    figure = build_figure([ddp])
    memory, speed = figure.axes[:2]
    assert memory.get_ylabel() == "peak memory per rank (GiB)"
    assert speed.get_ylabel() == "throughput per rank (samples/s)"
    assert memory.get_xlabel() == "batch size per rank (samples per step)"
    assert "DDP 2 ranks (gloo, buckets 25 MiB): memory, batch sizes and samples/s per rank (the global batch is 2 × " \
        "per rank)" in figure.get_suptitle()
    plain = build_figure([host_profile()])
    assert "per rank" not in plain.axes[0].get_ylabel() + plain.get_suptitle()


def test_profiles_of_far_apart_batch_scales_get_a_log_axis_short_legend_lines_and_no_borrowed_seq_len():
    """Issue 42 item 6: batch scales of 83 and 1,326 on one linear axis hid the small one; the title named one
    profile's seq_len for both; the legend's lines ran to 200 characters."""
    from vramcal.models.regressor.spec import RegressorSpec
    from vramcal.report.figure import LEGEND_WIDTH, build_figure

    small = gpu_profile()
    big = build_profile(gpu_device("NVIDIA H100 80GB HBM3", 80 * GIB),
                        [gpu_trial(b, int(0.4e9 + 3.7e6 * b)) for b in (1, 64, 256, 1024, 1326)],
                        spec=RegressorSpec(seq_len=64, d_model=64))
    figure = build_figure([small, big])
    memory = figure.axes[0]
    assert memory.get_xscale() == "log" and "seq_len" not in memory.get_title()
    lines = [line for text in figure.legends[0].get_texts() for line in text.get_text().splitlines()]
    assert len(lines) > 2 and max(len(line) for line in lines) <= LEGEND_WIDTH
    near = build_figure([small, host_profile()])
    assert near.axes[0].get_xscale() == "linear" and "(seq_len 128)" in near.axes[0].get_title()


def test_a_report_of_several_profiles_writes_each_profiles_own_report_too(tmp_path):
    paths = []
    for index, profile in enumerate((gpu_profile(), host_profile())):
        paths.append(tmp_path / f"{index}.json")
        save_profile(profile, paths[-1])
    result = CliRunner().invoke(main, ["report", *map(str, paths), "--out", str(tmp_path / "r"), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert Path(facts["markdown"]).name.startswith("compare-")
    own = [Path(p["markdown"]) for p in facts["profiles"]]
    assert [path.name for path in own] == [f"{report_name([load_profile(p)])}.md" for p in paths]
    assert all(path.exists() and path.with_suffix(".png").exists() for path in own)
    text = CliRunner().invoke(main, ["report", *map(str, paths), "--out", str(tmp_path / "t")]).output
    assert text.count("one profile's: ") == 2


def test_a_bad_report_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="plain file stem"):
        write_report([gpu_profile()], tmp_path, name="../escape")


def test_committed_profiles_regenerate(tmp_path):
    paths = sorted((MEASURED / "profiles").glob("**/*.json"))
    if not paths:
        pytest.skip("no committed profile yet")
    for path in paths:
        png, markdown = write_report([load_profile(path)], tmp_path)
        assert png_dimensions(png.read_bytes()) and "## Trials" in markdown.read_text()


def test_importing_the_report_modules_loads_no_matplotlib_or_torch():
    code = ("import sys, vramcal.report, vramcal.report.figure, vramcal.cli.report, vramcal.report.catalogue; "
            "print(sorted(m for m in ('matplotlib', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- commands

def test_report_command_writes_both_files(tmp_path):
    path = save_profile(gpu_profile(), tmp_path / "profiles" / "gpu.json")
    out = tmp_path / "reports"
    result = CliRunner().invoke(main, ["report", str(path), "--out", str(out), "--gpus", "RTX 4080=16GiB"])
    assert result.exit_code == 0, result.output
    assert sorted(p.suffix for p in out.iterdir()) == [".md", ".png"]
    assert "| RTX 4080 " in next(out.glob("*.md")).read_text()
    folder = CliRunner().invoke(main, ["report", str(tmp_path / "profiles"), "--out", str(out), "--name", "all"])
    assert folder.exit_code == 0 and (out / "all.png").exists()


def test_limits_command_prints_the_table(tmp_path):
    path = save_profile(gpu_profile(), tmp_path / "gpu.json")
    result = CliRunner().invoke(main, ["limits", str(path), "--gpus", "L4=22.5GiB"])
    assert result.exit_code == 0, result.output
    assert "| L4 " in result.output and "measured (verified)" in result.output and "**" not in result.output
    assert "extrapolations" in result.output


def test_commands_turn_bad_input_into_one_line_errors(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for command in ("report", "limits"):
        result = CliRunner().invoke(main, [command, str(broken)])
        assert result.exit_code == 1 and "is not valid JSON" in result.output
        assert "Traceback" not in result.output
    sparse = save_profile(sparse_profile(), tmp_path / "sparse.json")
    result = CliRunner().invoke(main, ["limits", str(sparse)])
    assert result.exit_code == 1 and "no fitted memory model" in result.output
    result = CliRunner().invoke(main, ["limits", str(sparse), "--gpus", "L4"])
    assert result.exit_code == 2 and "NAME=SIZE" in result.output
    assert json.loads(sparse.read_text())["fit"] is None


# ---------------------------------------------------------------------------------------------- run forecast

def timed_cards(tmp_path: Path) -> list[Path]:
    """Profiles of three cards, each with its own speed: two timed (RTX 4090, RTX A4000), one made before step
    times were recorded (RTX 3060: medians only)."""
    from profiles_for_tests import timed_profile

    cards = {"4090": timed_profile(),
             "a4000": timed_profile("NVIDIA RTX A4000", 16376 * 2**20, fixed_s=0.03, per_sample_s=0.0025),
             "3060": gpu_profile()}
    return [save_profile(p, tmp_path / "profiles" / f"{name}.json") for name, p in cards.items()]


def test_a_cost_table_of_several_cards_renders_in_markdown_json_and_png(tmp_path):
    from vramcal.report.cost_figure import DPI as COST_DPI
    from vramcal.report.cost_figure import FIGSIZE_IN as COST_FIGSIZE

    paths = timed_cards(tmp_path)
    args = [*map(str, paths), "--samples", "50000", "--val-samples", "5000", "--epochs", "50", "--out",
            str(tmp_path / "out"), "--name", "cards", "--price", "RTX 4090=0.59,RTX A4000=0.25,H100=2.49"]
    shown = CliRunner().invoke(main, ["cost", *args])
    assert shown.exit_code == 0, shown.output
    lines = {line.split("|")[1].strip(): line for line in shown.output.splitlines() if line.startswith("| ")}
    # the RTX 3060's old profile (its trials' medians) has no interval: nothing is measurably faster than it
    assert "| cheapest |" in lines["NVIDIA GeForce RTX 4090"] and "0.59" in lines["NVIDIA GeForce RTX 4090"]
    assert lines["H100"].count("unknown") == 4  # samples/s, epoch, run and cost: never guessed
    assert "predates per-step" in shown.output
    assert "no measurable difference in run time from NVIDIA GeForce RTX 3060 at batch size" in " ".join(
        shown.output.split())
    markdown = (tmp_path / "out" / "cards.md").read_text()
    assert "| H100 " in markdown and "**cheapest**" in markdown and "![Run time against cost" in markdown
    timed = CliRunner().invoke(main, ["cost", *args[:2], *args[3:]])  # the two timed cards: measurably apart
    assert "fastest, cheapest" in timed.output and "no measurable difference" not in timed.output
    width, height = png_dimensions((tmp_path / "out" / "cards.png").read_bytes())
    assert (width, height) == (COST_FIGSIZE[0] * COST_DPI, COST_FIGSIZE[1] * COST_DPI)
    data = json.loads(CliRunner().invoke(main, ["cost", *args, "--json", "--size-for", "throughput"]).output)
    rows = {r["card"]: r for r in data["forecasts"]}
    assert rows["H100"]["measured"] is False and rows["H100"]["samples_per_s"] is None and rows["H100"]["cost"] is None
    rtx = rows["NVIDIA GeForce RTX 4090"]
    assert rtx["cost"] == pytest.approx(0.59 * rtx["run_s"] / 3600) and rtx["batch_source"] in ("knee", "conservative")
    assert rtx["run_s"] == pytest.approx(50 * (50000 / rtx["samples_per_s"] + rtx["val_s"]) + rtx["first_s"])


def test_the_cost_command_cuts_windows_from_bars_or_data_and_refuses_two_datasets(tmp_path):
    from test_train_data import synthetic_bars

    paths = [str(p) for p in timed_cards(tmp_path)[:1]]
    synthetic_bars(3000).to_parquet(tmp_path / "bars.parquet")
    out = ["--out", str(tmp_path / "out")]
    by_bars = CliRunner().invoke(main, ["cost", *paths, *out, "--bars", "3000", "--stride", "64", "--val-fraction",
                                                "0.2", "--json"])
    by_data = CliRunner().invoke(main, ["cost", *paths, *out, "--data", str(tmp_path / "bars.parquet"), "--stride",
                                                "64", "--json"])
    counted = json.loads(by_bars.output)["forecasts"][0]["dataset"]
    cut = json.loads(by_data.output)["forecasts"][0]["dataset"]
    assert (counted["train_samples"], counted["val_samples"]) == (cut["train_samples"], cut["val_samples"]) == (36, 8)
    both = CliRunner().invoke(main, ["cost", *paths, *out, "--bars", "3000", "--samples", "10"])
    assert both.exit_code == 2 and "give one of --data, --bars and --samples" in both.output
    alone = CliRunner().invoke(main, ["cost", *paths, *out, "--val-samples", "10"])
    assert alone.exit_code == 2 and "--val-samples goes with --samples" in alone.output
    bad = CliRunner().invoke(main, ["cost", *paths, *out, "--price", "RTX 4090=free"])
    assert bad.exit_code == 2 and "is not a price per hour" in bad.output and "Traceback" not in bad.output
    from vramcal.cli.cost import forecastable

    options = {"data": None, "bars": 3000, "samples": None, "val_samples": None, "seq_len": 256, "stride": None,
               "val_fraction": 0.2}
    assert forecastable((Path(paths[0]),), options, lengths=False)[1][0].train_samples == 17  # windows of 256 bars
    other = CliRunner().invoke(main, ["cost", *paths, *out, "--seq-len", "256", "--bars", "3000"])
    assert other.exit_code == 1 and "calibrated at seq_len 128, not 256" in other.output  # a length it lacks


def test_the_report_forecasts_its_profile_at_the_conservative_size_and_the_knee(tmp_path):
    from profiles_for_tests import timed_profile

    profile = timed_profile(fixed_s=0.01, per_sample_s=0.01, sizes=(1, 8, 32, 64, 128), steps=10)
    text = render_markdown([profile], "x.png")
    section = text[text.index("## Throughput and run forecast"):text.index("## Trials")]
    assert "throughput knee (the smallest measured batch reaching 95 % of it) at batch 32" in section
    assert f"{profile.limits.conservative_batch_size} (conservative)" in section and "32 (knee)" in section
    assert "424 training samples and 105 validation samples" in section
    assert "| yes " in section  # the safe size's rate is steady (the steady trial)
    summary = text[:text.index("## Throughput and run forecast")]
    assert "| **Throughput** " in summary and "knee" in summary
    assert "at the conservative batch size and at the throughput knee (`--size-for throughput`):" in section
    flat = timed_profile(fixed_s=1.0, per_sample_s=0.0001)  # faster per sample up to the largest size: no knee below
    section = render_markdown([flat], "x.png").split("## Throughput and run forecast")[1].split("## Trials")[0]
    assert "(knee)" not in section  # one row, and the text says why
    assert ("at the conservative batch size (`--size-for throughput` trains at the same size: the notes say "
            "why):") in section and "is not below the conservative batch size" in section
    # two timed steps a size (intervals of about ±15 %): the knee's rate and the conservative size's overlap
    short = timed_profile(fixed_s=0.01, per_sample_s=0.01, sizes=(1, 8, 32, 64, 128))
    section = render_markdown([short], "x.png").split("## Throughput and run forecast")[1].split("## Trials")[0]
    assert "(knee)" not in section and "sizing for throughput: no measurable difference in samples/s" in section


def test_the_report_lists_runs_far_from_their_forecast(tmp_path):
    from vramcal.cli.console import time_line
    from vramcal.profile import Observation

    from profiles_for_tests import timed_profile

    profile = timed_profile()
    usable = profile.limits.usable_bytes
    observation = Observation("2026-01-01T00:00:00Z", "0.2.0", 225, 0, 10**10, 10**10, 10**10, usable, 10, "r",
                              samples_per_s=300.0, epoch_s=2.0, forecast_samples_per_s=600.0, forecast_epoch_s=1.0)
    close = dataclasses.replace(observation, epoch_s=1.1)
    noisy = dataclasses.replace(observation, epoch_s=1.3, time_band=0.34)  # +30 %: within its steps' noise
    text = render_markdown([dataclasses.replace(profile, observations=(observation, close, noisy))], "x.png")
    assert "| +100.0% | **far**" in text and "+10.0% | close" in text and "+30.0% | close" in text
    path = save_profile(dataclasses.replace(profile, observations=(observation, noisy)), tmp_path / "p.json")
    assert load_profile(path).observations[0].time_error == pytest.approx(1.0)
    assert load_profile(path).observations[1].time_band == 0.34
    assert "+30.0%, within 34 %" in time_line(noisy) and "+100.0%, FAR FROM" in time_line(observation)


def test_the_report_command_takes_the_forecast_options(tmp_path):
    path = timed_cards(tmp_path)[0]
    result = CliRunner().invoke(main, ["report", str(path), "--out", str(tmp_path / "r"), "--name", "f", "--epochs",
                                                 "3", "--samples", "1000", "--price", "RTX 4090=0.59,H100=2.49"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "r" / "f.md").read_text()
    assert "run of 3 epochs" in text and "| H100 " in text and "1,000 training samples" in text
    from test_train_data import synthetic_bars

    synthetic_bars(3000).to_parquet(tmp_path / "bars.parquet")
    for extra, phrase in ((["--data", str(tmp_path / "bars.parquet"), "--stride", "64", "--val-fraction", "0.25",
                            "--seq-len", "128"], "Each epoch: 34 training samples and 10 validation samples"),
                          (["--bars", "3000", "--stride", "64"], "Each epoch: 36 training samples and 8 validation"),
                          (["--samples", "500", "--val-samples", "50"], "500 training samples and 50 validation")):
        result = CliRunner().invoke(main, ["report", str(path), "--out", str(tmp_path / "r"), "--name", "g", *extra])
        assert result.exit_code == 0, result.output
        assert phrase in (tmp_path / "r" / "g.md").read_text()


def test_cost_rows_of_one_card_name_what_tells_their_models_apart_and_the_picture_makes_room(tmp_path):
    """Three profiles of one card: each row says only what differs (memory, family, settings), never a setting its
    family lacks nor one every profile shares; a config by its shape. The picture grows with its rows' names."""
    import io

    from PIL import Image

    from vramcal.cli.cost import _labels
    from vramcal.forecast import cost_table
    from vramcal.report.cost_figure import FIGSIZE_IN, render_cost_png
    from vramcal.workload import ModelRef

    from profiles_for_tests import timed_profile

    small, large = timed_profile(), timed_profile(total_bytes=48 * 2**30)
    large = dataclasses.replace(large, model=ModelRef.make(large.model.factory, {**large.model.params, "d_model": 256}))
    lm = dataclasses.replace(small, model=ModelRef.make("vramcal.models.lm:training_step", {
        "config": {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 8192, "state_size": 32}, "seq_len": 64}))
    labels = _labels([small, large, lm])
    assert labels[0].startswith("NVIDIA GeForce RTX 4090 · 23.99 GiB · regressor · d_model=")
    assert "48.00 GiB · regressor · d_model=256" in labels[1] and "d_state" not in labels[1]  # shared: left out
    assert labels[2].endswith("· lm · seq_len=64") and "d_model" not in labels[2]  # the lm has no d_model
    rows = cost_table([small, large, lm] * 3, [None] * 9, 10, labels=labels * 3)  # 9 rows of 4-5 lines each
    height = Image.open(io.BytesIO(render_cost_png(rows, "t"))).size[1]
    one = Image.open(io.BytesIO(render_cost_png(cost_table([small], [None], 10), "t"))).size[1]
    assert one == FIGSIZE_IN[1] * 100 < height


def test_cost_points_are_named_in_a_legend_that_marks_the_best_not_beside_each_other():
    """Cards of near cost and run time (two memories of one card) are named in the legend below the axes, the
    fastest and the cheapest marked there; no name is printed beside a point, where near ones would overlap."""
    from matplotlib.figure import Figure

    from vramcal.forecast import Price, calibration_dataset, cost_table
    from vramcal.report.cost_figure import _draw_costs

    from profiles_for_tests import timed_profile

    small, large = timed_profile(), timed_profile(total_bytes=48 * 2**30)
    datasets = [calibration_dataset(small), calibration_dataset(large)]
    rows = cost_table([small, large], datasets, 10, [Price("RTX 4090", 0.59)], labels=["4090 · 24", "4090 · 48"])
    ax = Figure().subplots()
    _draw_costs(ax, rows, ("minutes", 60.0))
    named = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(n.split(" (")[0] for n in named) == ["4090 · 24", "4090 · 48"]
    marked = [f"{f.card} ({', '.join(w for w, on in (('fastest', f.fastest), ('cheapest', f.cheapest)) if on)})"
              for f in rows if f.fastest or f.cheapest]
    assert marked and set(marked) <= set(named)
    assert not any("4090" in t.get_text() for t in ax.texts)
    many = [timed_profile(total_bytes=(16 + 8 * i) * 2**30) for i in range(8)]  # more cards than colours
    rows = cost_table(many, [calibration_dataset(p) for p in many], 10, [Price("RTX 4090", 0.59)],
                      labels=[f"4090 · {16 + 8 * i}" for i in range(8)])
    ax = Figure().subplots()
    _draw_costs(ax, rows, ("minutes", 60.0))
    points = [container.lines[0] for container in ax.containers]
    assert len({(line.get_color(), line.get_marker()) for line in points}) == len(points) == 8
