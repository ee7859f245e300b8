"""The trial journal: ``<profile>.journal``, a calibration's trials rewritten atomically after each one, so a
crash, a kill or a full disk loses none. A later calibration of the same :func:`plan_key` replays them while the
search (a function of the trials so far) asks for the same sizes, up to the first that differs or measured
nothing; saving the profile removes it.
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
    """What a :class:`vramcal.service.calibrator.CalibrationPlan` is, as JSON: equal keys run the same trials."""
    return {"device": plan.device.to_dict(), "model": plan.model.to_dict(), "settings": plan.settings.to_dict(),
            "trials": plan.trials.to_dict(), "world": plan.world.to_dict() if plan.world else None,
            "rank_devices": [d.to_dict() for d in plan.rank_devices], "options": plan.options,
            "seq_lens": list(plan.seq_lens), "vramcal_version": __version__, "software": software_versions()}


@dataclass
class Journal:
    """The journal at ``path`` of the calibration ``key`` (:func:`plan_key`): ``kept``, the previous run's trials
    to replay; ``made``, folders made for it (:meth:`discard`); ``notice``, one line for people about what was found."""

    path: Path
    key: dict[str, Any]
    made: tuple[Path, ...] = ()
    kept: list[Trial] = field(default_factory=list)
    notice: str | None = None

    @classmethod
    def open(cls, path: Path, key: dict[str, Any], made: tuple[Path, ...] = ()) -> Journal:
        """With an earlier run's measured trials, or empty (none, another calibration's, unreadable: a notice)."""
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
        """The kept trials from ``index`` when they are the ones asked for (one per purpose, or the last purpose's
        alone when it failed); else None, and the later ones are dropped (the search has gone another way)."""
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
