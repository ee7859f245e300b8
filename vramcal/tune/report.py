"""What a ``vramcal tune`` study leaves: the trials table, the best configuration, the PNG (matplotlib, Agg);
pure functions of the study, surplus trials left out."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from vramcal.files import atomic_write_bytes, atomic_write_text
from vramcal.train.config import TrainConfig
from vramcal.tune.study import BEST_CONFIG, PLOT, TRIALS_TABLE, SearchSpace, TuneSettings
from vramcal.tune.workers import shown_trials

COLUMNS = ("trial", "state", "seq_len", "lr", "batch", "used", "clamped", "weight_decay", "max_grad_norm", "epochs",
           "val_loss", "samples/s")


def table_rows(study) -> list[tuple[str, ...]]:
    """One row of strings per trial (but the surplus ones, which never ran), the best marked with ``*``."""
    best = best_trial(study)
    rows = []
    for t in shown_trials(study.trials):
        p, a = t.params, t.user_attrs

        def num(value, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        clamped = a.get("clamped")
        rows.append((f"{t.number}{'*' if best is not None and t.number == best.number else ''}",
                     t.state.name.lower(), num(p.get("seq_len"), "d"), num(p.get("lr"), ".3g"),
                     num(p.get("batch_size", a.get("batch_size")), "d"),
                     num(a.get("batch_size_used"), "d"), "-" if clamped is None else ("yes" if clamped else "no"),
                     num(p.get("weight_decay"), ".3g"), num(p.get("max_grad_norm"), ".3g"),
                     num(a.get("epochs"), "d"), num(a.get("val_loss"), ".5f"), num(a.get("samples_per_s"), ".1f")))
    return rows


def format_table(study) -> str:
    """The trials as an aligned Markdown table; the seq_len column only when the study searched lengths."""
    rows = [COLUMNS, *table_rows(study)]
    if all(row[2] == "-" for row in rows[1:]):
        rows = [row[:2] + row[3:] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def failure_lines(study) -> list[str]:
    """One line per failed trial with its recorded reason (``trial 3 failed: ...``)."""
    from optuna.trial import TrialState

    return [f"trial {t.number} failed: {t.user_attrs.get('error') or 'no reason recorded'}"
            for t in shown_trials(study.trials) if t.state == TrialState.FAIL]


def best_trial(study):
    """The complete trial with the lowest validation loss, or None."""
    from optuna.trial import TrialState

    complete = [t for t in study.trials if t.state == TrialState.COMPLETE and t.value is not None
                and math.isfinite(t.value)]
    return min(complete, key=lambda t: t.value) if complete else None


def study_summary(study, written: dict[str, Path]) -> dict:
    """What a study holds, for ``vramcal tune --json``: ``study_name``; ``best`` (``number``, ``value``, ``params``,
    ``batch_size_used``, ``run_dir``; None when none completed); ``trials`` counted per optuna state in lower case
    (surplus left out); ``files`` (``written``'s paths)."""
    from optuna.trial import TrialState

    best = best_trial(study)
    counts = Counter(t.state.name.lower() for t in shown_trials(study.trials))
    return {"study_name": study.study_name,
            "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params,
                                               "batch_size_used": best.user_attrs.get("batch_size_used"),
                                               "run_dir": best.user_attrs.get("run_dir")},
            "trials": {state.name.lower(): counts[state.name.lower()] for state in TrialState},
            "files": {name: str(path) for name, path in sorted(written.items())}}


def best_config(study, settings: TuneSettings) -> TrainConfig | None:
    """The best trial's training settings at the batch size it used, paths absolute (for ``train --config``)."""
    best = best_trial(study)
    if best is None:
        return None
    p = best.params
    length = {"seq_len": p["seq_len"]} if "seq_len" in p else {}
    return settings.base.replace(lr=p["lr"], batch_size=best.user_attrs.get("batch_size_used", p.get("batch_size")),
                                 weight_decay=p["weight_decay"], max_grad_norm=p["max_grad_norm"],
                                 **length).with_absolute_paths()


def write_results(study, settings: TuneSettings, space: SearchSpace, run_dir: Path) -> dict[str, Path]:
    """``best-config.json`` (for ``vramcal train --config``), ``trials.md`` and ``tune.png``, atomically.

    Raises:
        OSError: the run folder cannot be written.
    """
    run_dir = Path(run_dir)
    written = {"table": run_dir / TRIALS_TABLE, "plot": run_dir / PLOT}
    failures = "".join(f"\n- {line}" for line in failure_lines(study))
    atomic_write_text(written["table"], f"# {study.study_name}\n\n{space.describe()}\n\n{format_table(study)}\n"
                                        + (f"\nFailed trials:\n{failures}\n" if failures else ""))
    config = best_config(study, settings)
    if config is not None:
        written["best"] = run_dir / BEST_CONFIG
        atomic_write_text(written["best"], config.to_json())
    plot_study(study, None if space.searched else space.lengths[0][2], written["plot"])
    return written


_STYLE = {"complete": ("o", "tab:blue"), "pruned": ("x", "tab:orange"), "fail": ("s", "tab:red")}


def _points(study) -> list[tuple[int, str, float, int]]:
    """(trial number, state, lowest val_loss, batch size used) of trials that reported a validation loss."""
    points = []
    for t in shown_trials(study.trials):
        value = t.user_attrs.get("val_loss")
        batch = t.user_attrs.get("batch_size_used", t.params.get("batch_size", t.user_attrs.get("batch_size")))
        if value is not None and math.isfinite(value) and batch is not None:
            points.append((t.number, t.state.name.lower(), float(value), int(batch)))
    return points


def _draw_best_so_far(axes, points) -> None:
    """The lowest validation loss of the complete trials so far, as a step line, trial by trial."""
    complete = sorted((p for p in points if p[1] == "complete"), key=lambda p: p[0])
    if complete:
        best, xs, ys = math.inf, [], []
        for number, _, value, _ in complete:
            best = min(best, value)
            xs.append(number)
            ys.append(best)
        axes.step(xs, ys, where="post", color="black", linewidth=1, label="best so far")


def plot_study(study, bounds, path: Path) -> Path:
    """Write :func:`study_figure` to ``path`` as a PNG (atomically) and return it."""
    import io

    buffer = io.BytesIO()
    study_figure(study, bounds).savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path)


def study_figure(study, bounds):
    """The two-panel figure of a study (a matplotlib ``Figure``, Agg): validation loss per trial with the best so
    far, and against the batch size used (log scale) with the search bounds and the profile's limits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter, MaxNLocator

    points = _points(study)
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    history, by_batch = figure.subplots(1, 2)
    for state, (marker, color) in _STYLE.items():
        chosen = [p for p in points if p[1] == state]
        if chosen:
            history.scatter([p[0] for p in chosen], [p[2] for p in chosen], marker=marker, color=color, label=state)
            by_batch.scatter([p[3] for p in chosen], [p[2] for p in chosen], marker=marker, color=color, label=state)
    _draw_best_so_far(history, points)
    history.set(xlabel="trial", ylabel="validation loss (MSE)", title="optimisation history")
    history.xaxis.set_major_locator(MaxNLocator(integer=True))  # trial numbers, never 0.2
    by_batch.set_xscale("log")
    # plain numbers; minor ticks labelled up to 2.5 decades only (beyond, the labels overlap)
    labels = LogFormatter(labelOnlyBase=False, minor_thresholds=(2.5, 0.6))
    by_batch.xaxis.set_major_formatter(labels)
    by_batch.xaxis.set_minor_formatter(labels)
    lines = () if bounds is None else ((bounds.low, ":", "search bounds"), (bounds.high, ":", None),
                                       (bounds.conservative, "--", "conservative"), (bounds.safe, "-", "safe"))
    for x, style, label in lines:  # with several look-back windows each has its own bounds: none drawn
        by_batch.axvline(x, color="grey", linestyle=style, linewidth=1, label=label)
    by_batch.set(xlabel="batch size used", ylabel="validation loss (MSE)",
                 title="validation loss vs batch size")
    for axes in (history, by_batch):
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    figure.suptitle(f"vramcal tune: {study.study_name}, {len(shown_trials(study.trials))} trials")
    return figure
