"""The model families vramcal builds, in one place: ``regressor`` (:mod:`vramcal.models.regressor`), ``lm``
(:mod:`vramcal.models.lm`), the integrations' own models (:mod:`vramcal.models.own`) and any user's
``module:function``. What differs between them is a method of its :class:`Family`; no other module tells them apart
by name (they ask :func:`family` or :func:`family_of`)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramcal.arguments import mapping, of_type
from vramcal.models import lm
from vramcal.models.mamba2 import KEY_DEFAULTS, check_dtype, keyed_params, resolve_implementation
from vramcal.models.regressor.spec import FACTORY as REGRESSOR_FACTORY
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.records import Device
from vramcal.words import given, word
from vramcal.workload import ModelRef, WorkloadError, accepts, load_factory

# The usual Mamba-2 arguments first in titles, in this order; the rest alphabetically.
_ORDER = ("config", "d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "dtype")
_SHAPE = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("vocab_size", "vocab"), ("state_size", "state"))
REGRESSOR_OPTIONS = ("data", "stride", "val_fraction", "data_on_device")  # the regressor's data
DATA_OPTIONS = (*REGRESSOR_OPTIONS, "sample")  # the families' options: they do not change the model


@dataclass(frozen=True)
class Family:
    """A user's factory (``module:function``): the base every family refines.

    Attributes:
        name: the family's name (``regressor``, ``lm``), or ``factory`` for a user's.
        quiet: arguments left out of titles (fixed settings).
        spec_options: the command line's spec options (``--d-model``, ...) are its arguments (else ``--model-arg``).
        option_args: arguments filled from ``--seq-len``/``--dtype`` when ``--model-arg`` does not give them.
        documents: the trainer batches documents of every length for it, forecast per padded token
            (:mod:`vramcal.train.timing`).
    """

    factory: str
    name: str = "factory"
    quiet: tuple[str, ...] = ()
    spec_options: bool = False
    option_args: tuple[str, ...] = ()
    documents: bool = False

    def check(self, params: dict[str, Any], device: Device, implementation: str) -> ModelRef:
        """The checked reference of the factory with ``params`` on ``device``.
        Raises: WorkloadError: the factory cannot be imported, or takes no argument of a name in ``params``."""
        ref = ModelRef.make(self.factory, params)
        self.check_arguments(params)
        return ref

    def check_arguments(self, params: dict[str, Any]) -> None:
        """Raises: WorkloadError: the factory cannot be imported, or takes no argument of a name in ``params``."""
        factory = load_factory(ModelRef.make(self.factory))  # a missing module or function fails here, before a trial
        unknown = [name for name in params if not accepts(factory, name)]
        if unknown:
            variant = (" (activation checkpointing is the factory's to apply: give it a checkpointing parameter "
                       "that does so)" if "checkpointing" in unknown and self.name == "factory" else "")
            raise WorkloadError(f"the factory {self.factory} takes no {', '.join(map(repr, unknown))}{variant}: "
                                f"leave {given('params', f'{unknown[0]}=...')} out" +
                                (", or add the parameter to it" if self.name == "factory" else ""))

    def chunk_size(self, ref: ModelRef) -> int:
        """The model's chunk_size (sequence lengths are multiples of it); 1 when the factory names none."""
        return int(ref.params.get("chunk_size") or 1)

    def takes_seq_len(self, ref: ModelRef) -> bool:
        return accepts(load_factory(ref), "seq_len")

    def implementation(self, ref: ModelRef) -> str:
        """The Mamba-2 implementation a profile of ``ref`` records."""
        return str(ref.params.get("implementation", "factory"))

    def title(self, ref: ModelRef) -> str:
        """The family's name for people, or the factory's ``module:function``."""
        return self.factory if self.name == "factory" else self.name

    def label(self, ref: ModelRef) -> str:
        """A file-name-safe name: the family, or the user factory's function name."""
        if self.name != "factory":
            return self.name
        return re.sub(r"[^A-Za-z0-9_]+", "-", self.factory.rpartition(":")[2]).strip("-")

    def probe_args(self, ref: ModelRef) -> list[str]:
        """The ``vramcal probe`` options that calibrate ``ref`` (its model part)."""
        params = _without_implementation(ref)
        return [f"--model {ref.factory}", *(f"--model-arg {shlex.quote(f'{k}={_arg_text(v)}')}"
                                            for k, v in params.items())]

    def setting(self, ref: ModelRef, name: str) -> str:
        """A setting of ``ref`` for people: its value, or what leaving it out of the key means, never ``None``."""
        params = ref.params
        if name in params:
            return short_value(params[name])
        return str(KEY_DEFAULTS[name]) if self.name != "factory" and name in KEY_DEFAULTS else "not given"

    def data_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The data options that apply to this family's factory: none."""
        return {}

    def data_source(self, options: dict[str, Any]) -> str:
        """What the profile says its trials' data were."""
        return "the factory's"


@dataclass(frozen=True)
class Regressor(Family):
    """vramcal's regressor (:mod:`vramcal.models.regressor`)."""

    factory: str = REGRESSOR_FACTORY
    name: str = "regressor"
    quiet: tuple[str, ...] = ("n_features", "d_conv", "n_groups")
    spec_options: bool = True

    def check(self, params: dict[str, Any], device: Device, implementation: str) -> ModelRef:
        """Raises: ValueError: an impossible spec, or a dtype or implementation the device cannot run."""
        return self.ref(RegressorSpec.from_dict(params), device, implementation)

    def ref(self, spec: RegressorSpec, device: Device, implementation: str) -> ModelRef:
        """The key of a spec already made on ``device``. Raises: ValueError: a dtype or implementation it cannot run."""
        check_dtype(device, spec.dtype)
        return spec.ref(resolve_implementation(implementation, device.kind))

    def takes_seq_len(self, ref: ModelRef) -> bool:
        return True

    def probe_args(self, ref: ModelRef) -> list[str]:
        params, defaults = ref.params, {f.name: f.default for f in dataclasses.fields(RegressorSpec)}
        return [f"--{k.replace('_', '-')} {params[k]}" for k in defaults
                if k not in self.quiet and k in params and defaults[k] != params[k]]

    def data_options(self, options: dict[str, Any]) -> dict[str, Any]:
        picked = {k: options[k] for k in REGRESSOR_OPTIONS if k in options}
        if picked.get("data") is not None:
            picked["data"] = str(Path(picked["data"]).resolve())
        return picked

    def data_source(self, options: dict[str, Any]) -> str:
        return options.get("data") or "synthetic"


@dataclass(frozen=True)
class LanguageModel(Family):
    """A Mamba-2 causal language model from a ``Mamba2Config`` (:mod:`vramcal.models.lm`)."""

    factory: str = lm.FACTORY
    name: str = "lm"
    option_args: tuple[str, ...] = ("seq_len", "dtype")
    documents: bool = True

    def check(self, params: dict[str, Any], device: Device, implementation: str) -> ModelRef:
        """Raises: ValueError: no config or seq_len, or a bad one (:func:`vramcal.models.lm.check_params`)."""
        if "config" not in params or "seq_len" not in params:
            raise ValueError(f"{given('model', 'lm')} needs {given('params', 'config=<Mamba2Config JSON file>')} and "
                             f"{word('seq_len')}")
        self.check_arguments(params)  # an argument training_step does not take: one line here, not in a trial
        params = {"dtype": "fp32", **params, "config": lm.read_config(params["config"])}
        lm.check_params(params["config"], params["seq_len"], params["dtype"], params.get("checkpointing", "off"))
        check_dtype(device, params["dtype"])
        implementation = resolve_implementation(implementation, device.kind)
        return ModelRef.make(self.factory, {**keyed_params(params), "implementation": implementation})

    def chunk_size(self, ref: ModelRef) -> int:
        return lm.mamba2_config(ref.params["config"]).chunk_size

    def takes_seq_len(self, ref: ModelRef) -> bool:
        return True

    def probe_args(self, ref: ModelRef) -> list[str]:
        checkpointing = ref.params.get("checkpointing")
        lengths = ref.params.get("seq_len", "<its lengths>")  # a profile over several lengths keeps none
        return ["--model lm", "--model-arg config=<its config file>", f"--seq-len {lengths}",
                *([f"--model-arg checkpointing={checkpointing}"] if checkpointing else [])]


@dataclass(frozen=True)
class OwnModel(Family):
    """A model an integration calibrates as the run has it (:mod:`vramcal.models.own`), named by its class."""

    name: str = "own"
    quiet: tuple[str, ...] = ("data",)
    framework: str = ""

    def check(self, params: dict[str, Any], device: Device, implementation: str) -> ModelRef:
        """The reference as the integration made (and checked) it."""
        return ModelRef.make(self.factory, params)

    def implementation(self, ref: ModelRef) -> str:
        return self.framework

    def title(self, ref: ModelRef) -> str:
        return f"{self.label(ref)} ({self.framework})"

    def label(self, ref: ModelRef) -> str:
        """The model's class name."""
        return re.sub(r"[^A-Za-z0-9_]+", "-", str(ref.params.get("model", "")).rpartition(":")[2]).strip("-")

    def data_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The sample of the run's data (:func:`vramcal.models.own.save_sample`)."""
        return {"sample": str(options["sample"])} if options.get("sample") else {}

    def data_source(self, options: dict[str, Any]) -> str:
        return f"a sample of the run's own training data ({options.get('sample')})"


REGRESSOR = Regressor()
FAMILIES: dict[str, Family] = {"regressor": REGRESSOR, "lm": LanguageModel()}
OWN_MODELS = (OwnModel("vramcal.integrations.lightning:trial_step", framework="lightning"),
              OwnModel("vramcal.integrations.hf:trial_step", framework="transformers"))
_BY_FACTORY = {each.factory: each for each in (*FAMILIES.values(), *OWN_MODELS)}


def family(model: str) -> Family:
    """The family a ``--model`` choice names: ``regressor``, ``lm``, or a user's ``module:function``.
    Raises: WorkloadError: neither a family name nor ``module:function``."""
    found = FAMILIES.get(model) or _BY_FACTORY.get(model)
    if found is not None:
        return found
    if not ModelRef.is_factory_name(model):
        raise WorkloadError(f"{given('model', repr(model))} is neither {', '.join(FAMILIES)} nor module:function "
                            f"(e.g. mypackage.train:make_step)")
    return Family(model)


def family_of(ref: ModelRef) -> Family:
    """The family of a reference (by its factory)."""
    return _BY_FACTORY.get(ref.factory) or Family(ref.factory)


def model_ref(model: str | ModelRef, params: dict[str, Any] | None = None, *, device: Device,
              implementation: str = "auto") -> ModelRef:
    """The checked key of ``model`` on ``device`` (for vramcal's families with a concrete implementation:
    :func:`vramcal.models.mamba2.resolve_implementation`); a :class:`~vramcal.workload.ModelRef` as it is.

    Raises:
        ValueError: an impossible spec or config, or a dtype or implementation the device cannot run.
            WorkloadError: a user factory that cannot be imported. TypeError: an argument of the wrong type.
    """
    of_type("device", device, Device, "a vramcal.records.Device (vramcal.select_devices(gpu)[0][0])")
    if isinstance(model, ModelRef):
        return model
    of_type("model", model, str, "'regressor', 'lm', 'module:function' or a vramcal.ModelRef")
    of_type("implementation", implementation, str, "'auto', 'transformers' or 'mamba_ssm'")
    return family(model).check(arguments(params), device, implementation)


def arguments(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params=`` as a dict (None: none). Raises: TypeError: no mapping (``"d_model=32"``)."""
    return dict(mapping("params", params, "the model's arguments as a dict ({'d_model': 32})") or {})


def describe(ref: ModelRef) -> str:
    """One line for titles: the family, its arguments (:data:`_ORDER` first) and ``[implementation]``."""
    chosen = family_of(ref)
    params = {k: v for k, v in _without_implementation(ref).items() if k not in chosen.quiet}
    order = sorted(params, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))
    args = [str(params[k]) if k == "dtype" else f"{k}={short_value(params[k])}" for k in order]
    implementation = ref.params.get("implementation")
    tail = [f"[{implementation}]"] if implementation else []
    return " ".join([chosen.title(ref), *args, *tail])


def _without_implementation(ref: ModelRef) -> dict[str, Any]:
    return {k: v for k, v in ref.params.items() if k != "implementation"}


def short_value(value: Any) -> str:
    """A value for titles: a config dict by its shape (``(hidden 64, layers 2, +7 more)``), other dicts by size."""
    if isinstance(value, dict):
        shape = [f"{label} {value[key]}" for key, label in _SHAPE if key in value]
        rest = len(value) - len(shape)
        return f"({', '.join(shape)}{f', +{rest} more' if rest else ''})" if shape else f"{{{len(value)} settings}}"
    return str(value)


def differences(refs: Sequence[ModelRef]) -> list[tuple[str, str]]:
    """What tells each of ``refs`` apart: (its family where they differ, else ""; the settings that differ,
    ``d_model=256 seq_len=64``, else "")."""
    titles = [family_of(ref).title(ref) for ref in refs]
    params = [{k: v for k, v in ref.params.items() if v is not None} for ref in refs]
    differ = sorted(k for k in {k for each in params for k in each}
                    if len({str(each[k]) for each in params if k in each}) > 1)
    mixed = len(set(titles)) > 1
    return [(title if mixed else "", " ".join(f"{k}={short_value(own[k])}" for k in differ if k in own))
            for title, own in zip(titles, params)]


def _arg_text(value: Any) -> str:
    """A ``--model-arg`` value that reads back as ``value`` (JSON, else text)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value)
