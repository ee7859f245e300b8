"""The trial journal: a calibration's trials on disk as each one finishes, so a crash, a kill or a full disk
loses none of them.

``<profile>.journal`` beside the profile it will become: one JSON object, rewritten atomically after every
trial (:mod:`vramcal.files`), holding what the calibration is (:func:`plan_key`: device, model, limit and
trial settings, DDP world, data options, lengths, vramcal and the software that ran) and its trials in
order. A later calibration of the same plan replays them: the search is a function of the trials so far
(:mod:`vramcal.calibration.search`), so it asks again for the sizes they measured, and each one it asks for
in the same order is taken from the journal instead of being run; from the first that differs, and from the
first that measured nothing (an error or a timeout: the step may have been fixed since), trials run for
real. Saving the profile removes the journal, and so does a calibration that ends having measured nothing.
A journal of another plan is replaced, with a notice.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramcal import __version__
from vramcal.environment import software_versions
from vramcal.files import atomic_write_text
from vramcal.records import Trial
from vramcal.schema import SchemaError, read_list

SUFFIX = ".journal"
MEASURED = ("ok", "oom")  # what a trial measured; an error or a timeout measured nothing and is run again


def journal_path(profile_path: Path) -> Path:
    """``<profile>.journal``: beside the profile, outside the ``*.json`` that profile lookups read."""
    return profile_path.with_name(profile_path.name + SUFFIX)


def plan_key(plan: Any) -> dict[str, Any]:
    """What a calibration is, as JSON: two calibrations with equal keys run the same trials (a
    :class:`vramcal.calibrator.CalibrationPlan`; the software versions are the running ones)."""
    return {"device": plan.device.to_dict(), "model": plan.model.to_dict(), "settings": plan.settings.to_dict(),
            "trials": plan.trials.to_dict(), "world": plan.world.to_dict() if plan.world else None,
            "rank_devices": [d.to_dict() for d in plan.rank_devices], "options": plan.options,
            "seq_lens": list(plan.seq_lens), "vramcal_version": __version__, "software": software_versions()}


@dataclass
class Journal:
    """The journal of one calibration: the trials recorded so far and the ones a previous run left to replay.

    Attributes:
        path: the journal file. key: the calibration's :func:`plan_key`.
        made: folders made for it (removed by :meth:`discard` when empty).
        kept: the previous run's trials, in order (replayed while the search asks for them).
        notice: one line for people about what was found (trials to reuse, a journal of another plan replaced).
    """

    path: Path
    key: dict[str, Any]
    made: tuple[Path, ...] = ()
    kept: list[Trial] = field(default_factory=list)
    notice: str | None = None

    @classmethod
    def open(cls, path: Path, key: dict[str, Any], made: tuple[Path, ...] = ()) -> Journal:
        """The journal at ``path`` for the calibration ``key``: with the trials of an earlier run of the same
        calibration, or empty (none there, another calibration's, or unreadable: each with a notice)."""
        if not path.exists():
            return cls(path, key, made)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            trials = read_list(data["trials"], "trials", Trial.from_dict)
        except (OSError, ValueError, KeyError, TypeError, SchemaError) as error:
            return cls(path, key, made, notice=f"the trial journal {path} is unreadable ({error}): it is replaced")
        if data.get("key") != key:
            return cls(path, key, made, notice=f"the trial journal {path} is of another calibration (other "
                                               f"settings, software or device): it is replaced")
        measured = list(itertools.takewhile(lambda t: t.status in MEASURED, trials))
        if not measured:
            return cls(path, key, made)
        return cls(path, key, made, measured, notice=f"{len(measured)} trial(s) of an earlier run of this "
                                                     f"calibration are in {path}: they are reused while the "
                                                     f"search asks for them")

    def replay(self, index: int, batch_size: int, purposes: tuple[str, ...], seq_len: int | None) -> list[Trial] | None:
        """The kept trials from ``index`` that the trial asked for recorded — one per purpose in ``purposes``
        (a steady trial that verifies records two), or its last purpose's alone when that trial failed — when
        they are the ones asked for (same batch size, purposes and length); else None, and none of the later
        ones either (the search has gone another way)."""
        kept = self.kept[index:index + len(purposes)]
        asked = [(batch_size, purpose, seq_len) for purpose in purposes]
        found = [(t.batch_size, t.purpose, t.seq_len) for t in kept]
        if found == asked:
            return kept
        if kept and found[0] == asked[-1] and not kept[0].ok:
            return kept[:1]
        del self.kept[index:]
        return None

    def record(self, trials: list[Trial]) -> None:
        """Write the trials so far (atomically: on a failure the previous journal stays).

        Raises:
            OSError: the journal cannot be written (a full disk), naming the file.
        """
        text = json.dumps({"key": self.key, "trials": [t.to_dict() for t in trials]}, sort_keys=True)
        atomic_write_text(self.path, text + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Nothing to keep (the first trial failed): remove the journal and the folders made for it, if empty."""
        self.remove()
        for folder in self.made:
            with contextlib.suppress(OSError):
                folder.rmdir()
