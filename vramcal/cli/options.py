"""Option types and option groups shared by several commands, declared once."""

from __future__ import annotations

import functools

import click

from vramcal.model import DTYPE_POLICIES, ModelSpec
from vramcal.units import format_bytes, parse_bytes

_DEFAULTS = ModelSpec()


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
            self.fail(f"{value} is below the minimum of {format_bytes(self.min_bytes)}", param, ctx)
        return n_bytes


def spec_options(command):
    """The ModelSpec options shared by probe, train and tune (field names as the options)."""
    options = [
        click.option("--d-model", type=click.IntRange(1), default=_DEFAULTS.d_model, show_default=True),
        click.option("--n-layers", type=click.IntRange(1), default=_DEFAULTS.n_layers, show_default=True),
        click.option("--d-state", type=click.IntRange(1), default=_DEFAULTS.d_state, show_default=True),
        click.option("--headdim", type=click.IntRange(1), default=_DEFAULTS.headdim, show_default=True),
        click.option("--expand", type=click.IntRange(1), default=_DEFAULTS.expand, show_default=True),
        click.option("--chunk-size", type=click.IntRange(1), default=_DEFAULTS.chunk_size, show_default=True),
        click.option("--seq-len", type=click.IntRange(1), default=_DEFAULTS.seq_len, show_default=True),
        click.option("--dtype", type=click.Choice(DTYPE_POLICIES), default=_DEFAULTS.dtype, show_default=True,
                     help="fp32, or fp32 weights with bf16 autocast (CUDA only)"),
    ]
    return functools.reduce(lambda cmd, option: option(cmd), reversed(options), command)


def spec_from_options(options: dict) -> ModelSpec:
    """Pop the spec options from a click kwargs dict and build a validated ModelSpec.

    Raises:
        click.BadParameter: the spec is impossible; the message says which values would work.
    """
    names = ("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "dtype")
    spec = ModelSpec(**{name: options.pop(name) for name in names})
    try:
        spec.validate()
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="model spec") from None
    return spec
