"""The calibration core, pure: the fits, the limits, the search policy, the surface over lengths and the step
creep, each a function of recorded trials (tested with recorded and synthetic ones). The loop that runs real
trials against it is :mod:`vramcal.calibrator`, above the profile."""

from __future__ import annotations

import dataclasses
from typing import Any

from vramcal.schema import read_record


class Record:
    """A dataclass a file holds field for field, named ``WHERE`` in messages, its numbers in ``RANGES``, its nested
    records read by ``READERS`` (:func:`vramcal.schema.read_record`)."""

    WHERE = "record"
    RANGES: dict = {}
    READERS: dict = {}  # field -> (value, path) -> value, for nested records

    def to_dict(self) -> dict:
        """The record as JSON holds it (tuples as lists)."""
        return _lists(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict, where: str | None = None) -> Any:
        """Raises: SchemaError: a field missing, unknown, of the wrong type or out of range (named)."""
        return read_record(cls, data, where or cls.WHERE, cls.RANGES, cls.READERS)


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    return [_lists(item) for item in value] if isinstance(value, tuple | list) else value
