"""The click types of vramcal's options: sizes, lists, ranges and choices, each read by vramcal's one parser."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from vramcal.calibration.fit2d import SeqLens, parse_seq_lens
from vramcal.calibration.lengths import parse_buckets
from vramcal.measure.device import DeviceError, check_choice
from vramcal.models.mamba2 import checkpoint_every
from vramcal.report.catalogue import parse_gpu_list
from vramcal.train.config import REPORT_TO
from vramcal.units import format_bytes, parse_bytes


class ByteSize(click.ParamType):
    """A size such as ``12GiB``, parsed by :func:`vramcal.units.parse_bytes`."""

    name = "size"

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes

    def convert(self, value, param, ctx):
        try:
            n_bytes = value if isinstance(value, int) else parse_bytes(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)
        if n_bytes < self.min_bytes:
            bare = isinstance(value, str) and value.strip().replace(".", "", 1).isdigit()  # bytes, without a unit
            self.fail(f"{value} is below the minimum of {format_bytes(self.min_bytes)}"
                      + ("; a number without a unit is bytes: write a unit, e.g. 24GiB" if bare else ""), param, ctx)
        return n_bytes


class CommaList(click.ParamType):
    """A comma list option, read by the subclass's :meth:`read` once it names at least one entry (an empty list is
    a bad value); a value already read (a list or tuple) passes as it is."""

    example = ""  # a good value, for the refusal
    file_type: Any = str  # what a defaults file may give (vramcal.cli.defaults.file_type): text

    def convert(self, value, param, ctx):
        if isinstance(value, list | tuple):
            return value
        if not any(part.strip() for part in str(value).split(",")):
            self.fail(f"{str(value)!r} names nothing: give at least one, e.g. {self.example}", param, ctx)
        try:
            return self.read(str(value), param, ctx)
        except ValueError as error:
            self.fail(str(error), param, ctx)

    def read(self, text: str, param, ctx) -> Any:
        """The entries of ``text``. Raises: ValueError, or click's BadParameter."""
        raise NotImplementedError


class ByteSizes(CommaList, ByteSize):
    """One size, or a comma list (one per local rank of a DDP run on the host): a tuple of byte counts."""

    name = "size[,size...]"
    example = "12GiB"
    file_type = str | int  # a whole number is bytes, as ByteSize reads it

    def read(self, text: str, param, ctx) -> tuple[int, ...]:
        return tuple(ByteSize.convert(self, part.strip(), param, ctx) for part in text.split(","))


class FiniteFloat(click.FloatRange):
    """A float range that refuses NaN and infinities (click's ranges let NaN through)."""

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class BatchSize(click.ParamType):
    """``auto`` (None) or a positive integer."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or str(value).lower() == "auto":
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither auto nor an integer", param, ctx)
        if number < 1:
            self.fail(f"{number} is not >= 1", param, ctx)
        return number


class SeqLenList(click.ParamType):
    """One sequence length, a list ``128,512,2048`` or a range ``128:2048``
    (:func:`vramcal.calibration.fit2d.parse_seq_lens`)."""

    name = "N|N,N,...|LOW:HIGH"

    def convert(self, value, param, ctx):
        if isinstance(value, SeqLens):
            return value
        try:
            return parse_seq_lens(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


class Buckets(CommaList):
    """``--buckets``: boundaries ``128,256,512`` or ``auto`` (:func:`vramcal.calibration.lengths.parse_buckets`)."""

    name = "N,N,...|auto"
    example = "128,256,512 or auto"
    file_type = str | int  # one bucket

    def read(self, text: str, param, ctx) -> tuple[int, ...]:
        return parse_buckets(text)


class Checkpointing(click.ParamType):
    """``--checkpointing off|block|every:K`` in form (:func:`vramcal.models.mamba2.checkpoint_every`)."""

    name = "off|block|every:K"
    file_type = str

    def convert(self, value, param, ctx):
        try:
            checkpoint_every(value)
        except ValueError as error:
            self.fail(str(error).removeprefix("checkpointing "), param, ctx)
        return value


class Reporters(CommaList):
    """``--report-to tensorboard,mlflow`` or ``none``: names of :data:`vramcal.train.config.REPORT_TO`, each once."""

    name = ",".join(REPORT_TO) + "|none"
    example = "tensorboard, or none"

    def read(self, text: str, param, ctx) -> tuple[str, ...]:
        names = () if text.strip() == "none" else tuple(n.strip() for n in text.split(","))
        unknown = [n for n in names if n not in REPORT_TO]
        if unknown or len(set(names)) != len(names):
            self.fail(f"{text!r}: name each of {', '.join(REPORT_TO)} at most once, separated by commas, or none",
                      param, ctx)
        return names


class KeyValue(click.ParamType):
    """``KEY=VALUE``; the value is read as JSON when it parses (numbers, true/false, lists), else as text."""

    name = "KEY=VALUE"
    file_type = str

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        key, sep, text = str(value).partition("=")
        if not sep or not key.isidentifier():
            self.fail(f"{value!r} is not KEY=VALUE with KEY a Python identifier", param, ctx)
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        if isinstance(parsed, float) and not math.isfinite(parsed):
            self.fail(f"{key}: {text} is not a finite number", param, ctx)
        return key, parsed


class GpuList(CommaList):
    """``--gpus "H200,RTX 4090,My card=24GiB"``: catalogued cards by name, others as NAME=SIZE
    (:func:`vramcal.report.catalogue.parse_gpu_list`)."""

    name = "CARD[,CARD...]"
    example = '"H200,RTX 4090,My card=24GiB"'

    def read(self, text: str, param, ctx) -> list:
        return parse_gpu_list(text)


class GpuChoice(click.ParamType):
    """A ``--gpu`` value in form (:func:`vramcal.measure.device.check_choice`)."""

    name = "gpu"

    def convert(self, value, param, ctx):
        try:
            return check_choice(str(value))
        except DeviceError as error:
            self.fail(str(error).removeprefix("--gpu "), param, ctx)
