"""``vramcal report`` and ``vramcal limits``: thin click commands over :mod:`vramcal.report`.

Both read profile files only, so a profile made on a GPU box reports anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from vramcal.cli.console import estimate_lines
from vramcal.cli.cost import forecast_options, forecast_settings, forecastable
from vramcal.cli.options import EXIT_UNVERIFIED, load_profiles, one_line, strict_option
from vramcal.cli.probe import warn_if_stale
from vramcal.cli.types import Buckets, GpuList
from vramcal.estimate import EstimateError
from vramcal.estimate.learned import estimate_cards, traced_options
from vramcal.files import os_advice
from vramcal.models.registry import describe
from vramcal.report import variants_png_names, write_report
from vramcal.report.catalogue import GpuModel, cards_for, other_gpu_limits
from vramcal.report.lengths import lengths_lines
from vramcal.report.markdown import device_label, limits_notes, limits_table, missing_notes
from vramcal.report.variants import group_rows, variant_groups
from vramcal.report.world import world_heading, world_rows, world_table
from vramcal.service import pool
from vramcal.sizing import answer, batching
from vramcal.units import format_bytes
from vramcal.workload import WorkloadError

GPUS_HELP = ('more cards for the other-GPU table, e.g. "RTX 4080=16GiB,L4=22.5GiB" '
             "(GiB binary, GB decimal; a catalogued card by its name, e.g. H200)")


@click.command("report")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="folder for the PNG and the Markdown")
@click.option("--name", default=None, help="file stem (default: <device>-<model>-<implementation>-<hash>, "
                                           "or compare-<hash> for several profiles)")
@click.option("--gpus", type=GpuList(), default=[], help=GPUS_HELP)
@click.option("--json", "as_json", is_flag=True, help="print the files written and each profile's limits as JSON")
@forecast_options
def report_command(profiles: tuple[Path, ...], out_dir: Path, name: str | None, gpus: list[GpuModel],
                   as_json: bool, **options) -> None:
    """Write a PNG and a Markdown report from profile files.

    PROFILES are profile files, or folders (every profile below them). Several profiles are drawn on
    one figure as comparable series, and each also gets its own report beside it. The report's run forecast (as
    `vramcal cost`) takes the forecast options.
    """

    loaded, datasets, left_out = forecastable(profiles, options, lengths=False)  # the forecast says its lengths
    paths = [p.path for p in loaded]
    for line in left_out:
        click.echo(line, err=True)
    try:
        png, markdown = write_report(loaded, out_dir, name=name, extra_gpus=gpus,
                                     forecast=forecast_settings(datasets, options))
        own = [write_report([p], out_dir, extra_gpus=gpus, forecast=forecast_settings([d], options))
               for p, d in zip(loaded, datasets)] if len(loaded) > 1 else []
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--name") from None
    except OSError as error:
        raise click.ClickException(f"cannot write the report to {out_dir} ({error.strerror}): "
                                   f"{os_advice(error, '--out')}") from None
    if not as_json:
        click.echo(f"report: {markdown} and {png}")
        for each_png, each_markdown in own:
            click.echo(f"  one profile's: {each_markdown} and {each_png}")
        return
    facts = [{"profile": str(path), "verified": p.verified, "limits": p.limits.to_dict() if p.limits else None,
              "observations": len(p.observations),
              **({"png": str(own[i][0]), "markdown": str(own[i][1])} if own else {})}
             for i, (path, p) in enumerate(zip(paths, loaded))]
    click.echo(json.dumps({"png": str(png), "markdown": str(markdown), "profiles": facts, "left_out": left_out,
                           "variants": _variants_json(paths, loaded, png)}, indent=2, sort_keys=True))


def _variants_json(paths: list[Path], loaded: list, png: Path) -> list[dict]:
    """Each group of variants of one model the report shows: its figure and its rows (``VariantRow.to_dict``)."""
    groups = variant_groups(loaded)
    path_of = {id(p): path for path, p in zip(paths, loaded)}
    return [{"png": str(png.with_name(figure)), "rows": [row.to_dict() for row in
                                                         group_rows(group, [path_of[id(p)] for p in group])]}
            for group, figure in zip(groups, variants_png_names(png.stem, len(groups)))]


@click.command("limits")
@click.argument("profile", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpus", type=GpuList(), default=[], help=GPUS_HELP)
@click.option("--seq-len", type=click.IntRange(1), default=None,
              help="safe and conservative batch sizes at this length (a profile calibrated over several lengths)")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="the longest seq_len at this batch size (a profile calibrated over several lengths)")
@click.option("--buckets", type=Buckets(), default=None,
              help="a profile calibrated over several lengths: the safe and conservative batch of each seq_len "
                   "bucket, named by its longest length (128,256,512,1024), or auto (the calibration's choice)")
@click.option("--token-budget", is_flag=True,
              help="a profile calibrated over several lengths: the most tokens per batch of documents up to its "
                   "longest seq_len (each batch padded to a multiple of chunk_size), and its worst length")
@click.option("--verify", is_flag=True,
              help="run one real trial at the answer (on the profile's device, here); with --buckets or "
                   "--token-budget, at each worst case no recorded trial verified")
@click.option("--world-size", type=click.IntRange(2), default=None,
              help="a world's profile: its per-rank and global limits at this many ranks on each card, computed by "
                   "the sharding model")
@click.option("--global-batch", type=click.IntRange(1), default=None,
              help="a world's profile: the fewest ranks whose conservative size carries this many samples per "
                   "optimizer step, on each card")
@click.option("--profiles-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("profiles"),
              show_default=True, help="a host profile's GPU estimates learn their baseline and bound from these")
@click.option("--json", "as_json", is_flag=True, help="print the answer or the table as JSON for programs")
@strict_option
@click.pass_context
def limits_command(ctx: click.Context, profile: Path, gpus: list[GpuModel], seq_len: int | None,
                   batch_size: int | None, buckets: tuple[int, ...] | None, token_budget: bool, verify: bool,
                   world_size: int | None, global_batch: int | None, profiles_dir: Path, as_json: bool,
                   strict_profile: bool) -> None:
    """Print PROFILE's limits: on common GPUs, or at a sequence length or batch size.

    The GPU table is the report's "Limits on other GPUs": for a GPU profile, its fit carried to each card
    (roughly: the context and kernels differ by card); a host profile is never carried to a GPU, whose rows are
    estimated instead (`vramcal estimate`, with the bound learned from --profiles-dir). With --seq-len or
    --batch-size, the answer of a profile calibrated over several lengths; --verify checks it with a real trial
    (exit 3 when that trial does not fit). With --buckets or --token-budget, how a run on documents of varying
    length batches them: per-bucket batch sizes, or a token budget, each with its worst case verified. With
    --world-size or --global-batch, a world's profile (`vramcal probe --nproc N`) at other world sizes: under
    FSDP the model states divide by the ranks, the rest of the measured fit does not.
    """

    loaded = load_profiles((profile,))[0][0]
    with one_line():
        warn_if_stale(loaded, profile, strict_profile)
    questions = (("--seq-len", seq_len), ("--batch-size", batch_size), ("--buckets", buckets),
                 ("--token-budget", token_budget), ("--world-size", world_size), ("--global-batch", global_batch))
    asked = [flag for flag, given in questions if given is not None and given is not False]
    if len(asked) > 1 and set(asked) != {"--buckets", "--token-budget"}:
        raise click.UsageError(f"{asked[0]} and {asked[1]} ask different questions: give one of them")
    if world_size is not None or global_batch is not None:
        if verify:
            raise click.UsageError(f"--verify and {asked[0]} ask different questions: give one of them")
        _world_table(profile, loaded, gpus, world_size, global_batch, as_json)
        return
    if buckets is not None or token_budget:
        ctx.exit(_lengths(profile, loaded, buckets, token_budget, verify, as_json))
    if seq_len is None and batch_size is None:
        if verify:
            raise click.BadParameter("--verify checks an answer: give --seq-len or --batch-size", param_hint="--verify")
        _gpu_table(profile, loaded, gpus, as_json, profiles_dir)
        return

    with one_line():
        found = answer(loaded, seq_len=seq_len, batch_size=batch_size)
        trial = pool.verify(loaded, found.batch_size, found.seq_len) if verify else None
    _print_answer(found, trial, as_json)
    if trial is not None and not trial.fits(found.usable_bytes):
        ctx.exit(EXIT_UNVERIFIED)


def _print_answer(found, trial, as_json: bool) -> None:
    if as_json:
        check = None if trial is None else {"status": trial.status, "peak_bytes": trial.peak_bytes,
                                            "fits": trial.fits(found.usable_bytes)}
        click.echo(json.dumps({**dataclasses.asdict(found), "verification": check}, indent=2, sort_keys=True))
        return
    click.echo(found.sentence)
    click.echo(f"seq_len {found.seq_len}: safe batch_size {found.safe_batch_size}, conservative "
               f"{found.conservative_batch_size} ({found.basis})")
    click.echo(f"at batch_size {found.batch_size}: predicted peak {format_bytes(found.predicted_peak_bytes)}, upper "
               f"bound {format_bytes(found.upper_bytes)}, usable {format_bytes(found.usable_bytes)}")
    if trial is not None:
        verdict = (f"verified: peak {format_bytes(trial.peak_bytes)}" if trial.fits(found.usable_bytes) else
                   f"NOT verified: {trial.status}" + (f", peak {format_bytes(trial.peak_bytes)}" if trial.ok else ""))
        click.echo(f"real trial at batch_size {found.batch_size}, seq_len {found.seq_len}: {verdict}")


def _lengths(path: Path, loaded, boundaries: tuple[int, ...] | None, with_budget: bool, verify: bool,
             as_json: bool) -> int:
    """The bucket table and/or the token budget, each worst case verified here where asked; the exit status."""
    with one_line():
        table, worst = batching.buckets(loaded, boundaries) if boundaries is not None else (None, [])
        found, budget_worst = batching.budget(loaded) if with_budget else (None, ())
        cases = [*([worst] if table else []), *budget_worst]
        trials = {case: pool.verify(loaded, case.batch_size, case.seq_len) for case in cases
                  if verify and case.check is None}
    usable = loaded.settings.usable_bytes(loaded.device.total_bytes)
    results = [(case, _verdict(case, trials.get(case), usable)) for case in cases]
    if as_json:
        click.echo(json.dumps({"profile": str(path), "chunk_size": loaded.surface.chunk_size,
                               "buckets": table and [b.to_dict() for b in table],
                               "token_budget": found and found.to_dict(),
                               "worst_cases": [{"what": c.what, "seq_len": c.seq_len, "batch_size": c.batch_size,
                                                **v} for c, v in results]}, indent=2, sort_keys=True))
    else:
        for line in lengths_lines(loaded, table, found, results):
            click.echo(line)
    return EXIT_UNVERIFIED if any(v["verified"] is False for _, v in results) else 0


def _verdict(case, trial, usable: int) -> dict:
    """A worst case's verification: the profile's recorded trial, the real trial run now, or none."""
    if trial is not None:
        return {"verified": trial.fits(usable), "peak_bytes": trial.peak_bytes, "by": f"a real trial now "
                f"({trial.status})"}
    if case.check is not None:
        return {"verified": case.check.passed, "peak_bytes": case.check.peak_bytes, "by": "the calibration's trial"}
    return {"verified": None, "peak_bytes": None, "by": "no trial (--verify runs one)"}


def _gpu_table(path: Path, loaded, gpus: list[GpuModel], as_json: bool, profiles_dir: Path) -> None:

    try:
        rows = other_gpu_limits(loaded, gpus)
    except ValueError as error:
        raise click.ClickException(f"{path}: {error}") from None
    world = loaded.world
    estimated, why = _estimated(loaded, gpus, profiles_dir) if not loaded.device.kind.cuda_kernels else (None, None)
    if as_json:
        click.echo(json.dumps({"profile": str(path), "verified": loaded.verified, "formula": loaded.fit.formula(),
                               "world": world.to_dict() if world else None,
                               "gpus": [{"gpu": r.gpu.label, "measured": r.measured, **r.limits.to_dict()}
                                        for r in rows],
                               "estimated": estimated.to_dict() if estimated else None, "not_estimated": why},
                              indent=2, sort_keys=True))
        return
    click.echo(f"{loaded.fit.formula()}  (r² = {loaded.fit.r_squared:.4f}, n = {loaded.fit.n_points})")
    click.echo(f"measured on {device_label(loaded)}, {loaded.implementation}, {describe(loaded.model)}")
    if world is not None:
        safe, conservative, n = loaded.limits.safe_batch_size, loaded.limits.conservative_batch_size, world.nproc
        click.echo(f"{world.describe()}: the batch sizes below are per rank; this card's world trains {n} x per rank "
                   f"(safe {safe} -> global {n * safe}, conservative {conservative} -> global {n * conservative})")
    for note in missing_notes(loaded):
        click.echo(note)
    click.echo("")
    click.echo(limits_table(rows, loaded.verified, bold=False))
    click.echo("")
    for note in limits_notes(loaded):
        click.echo(click.wrap_text(note, width=110, initial_indent="- ", subsequent_indent="  "))
    if estimated is not None or why:
        click.echo("")
        for line in estimate_lines(estimated) if estimated is not None else [f"GPUs not estimated: {why}"]:
            click.echo(line)


def _world_table(path: Path, loaded, gpus: list[GpuModel], world_size: int | None, global_batch: int | None,
                 as_json: bool) -> None:

    try:
        rows = world_rows(loaded, gpus, nproc=world_size, global_batch=global_batch)
        heading = world_heading(loaded)
    except ValueError as error:  # SizingError too
        raise click.ClickException(f"{path}: {error}") from None
    if as_json:
        click.echo(json.dumps({"profile": str(path), "world": loaded.world.to_dict(),
                               "computed_by": "vramcal.sizing.sharding", "world_size": world_size,
                               "global_batch": global_batch,
                               "gpus": [row.to_dict() for row in rows]}, indent=2, sort_keys=True))
        return
    click.echo(click.wrap_text(heading, width=110))
    click.echo("")
    if global_batch is not None:
        click.echo(f"fewest ranks for a global batch of {global_batch:,} samples at the conservative size per rank:")
    click.echo(world_table(rows, global_batch))


def _estimated(loaded, gpus: list[GpuModel], profiles_dir: Path):
    """(the estimate of a host profile's model on the catalogue and ``gpus``, None) or (None, why not)."""

    if loaded.world is not None or loaded.surface is not None:
        return None, "a DDP world or several lengths: estimate one process at one length with `vramcal estimate`"
    try:
        return estimate_cards(loaded.model, traced_options(loaded), cards=cards_for(gpus), settings=loaded.settings,
                              profiles_dir=profiles_dir), None
    except (EstimateError, WorkloadError, ValueError) as error:
        return None, str(error)
