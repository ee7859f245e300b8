"""The trainer's settings: one frozen dataclass, read from and written to a JSON or TOML file with the ``vramcal
train`` options' names (the spec flat or under ``spec``); options on the command line override the file."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vramcal.models import registry
from vramcal.models.mamba2 import IMPLEMENTATIONS
from vramcal.models.regressor.spec import RegressorSpec
from vramcal.schema import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, SchemaError, read_value
from vramcal.sizing import SizeRequest
from vramcal.words import word

LrScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")
SIZE_FORS: tuple[str, ...] = ("memory", "throughput")
SEED_BATCH_SIZE = 96  # the seed documents' training batch size, the default LR reference
VARIANT_CHOICES: tuple[str, ...] = ("spec", "auto")  # train the spec as given, or the fastest calibrated variant
Reporter = Literal["tensorboard", "mlflow"]
REPORT_TO: tuple[str, ...] = ("tensorboard", "mlflow")  # where a run's figures go beside metrics.jsonl
MODELS: tuple[str, ...] = ("regressor", "lm")  # what vramcal train trains: the regressor on bars, or an LM on text
BATCHINGS: tuple[str, ...] = ("budget", "buckets")  # how the lm's batches are formed (vramcal.sizing.sampler)


def trains_documents(model: str) -> bool:
    """Whether ``model`` (a run's ``--model``) names a family trained on documents of every length (its
    ``documents``: the language model on text), not the regressor on bars."""
    return model in MODELS and registry.family(model).documents


class ConfigError(ValueError):
    """A config file or value the trainer cannot use; the message names it and what would work."""

# The settings ``--resume`` may change: the run's length (the cosine decay stretched to it), and the learning
# rate and clipping (after a divergence or a NaN, continue from the last finite checkpoint more gently).
RESUME_OVERRIDES = ("epochs", "max_steps", "lr", "max_grad_norm")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on: each setting is the ``vramcal train`` option of that name, its help the
    meaning and unit; the spec is the model (the profile key).

    Attributes:
        batch_size: samples per optimizer step; None = sized by ``size_for``
            (:func:`vramcal.sizing.throughput_choice`).
        effective_batch_size: samples per optimizer step accumulated over micro-batches
            (:func:`vramcal.sizing.accumulation`).
        lr: peak learning rate at ``reference_batch_size`` (5e-5: the seed documents' fix for an oscillating loss),
            scaled by ``lr_scaling``: ``linear`` (Goyal et al. 2017) or ``sqrt`` (Malladi et al. 2022).
        warmup_steps: None = 5 % of the run's steps (at least 1).
        val_batch_size: None = :func:`vramcal.train.plan.validation`'s choice.
        model: ``regressor`` (on ``data``) or ``lm`` (``lm_config`` on ``text``: :mod:`vramcal.train.lm_plan`).

    Paths are used as given; files written for later use hold them absolute (:meth:`with_absolute_paths`).

    Raises:
        ConfigError: a value out of range; lr, weight_decay and max_grad_norm must also be finite.
    """

    data: str = "data/es_1s.parquet"
    spec: RegressorSpec = field(default_factory=RegressorSpec)
    implementation: str = "auto"
    gpu: str = "auto"
    profile: str = "auto"
    profiles_dir: str = "profiles"
    batch_size: int | None = None
    batch_size_min: int = 1
    effective_batch_size: int | None = None
    size_for: Literal["memory", "throughput"] = "memory"
    lr: float = 5e-5
    lr_scaling: LrScaling = "sqrt"
    reference_batch_size: int = SEED_BATCH_SIZE
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    warmup_steps: int | None = None
    min_lr_fraction: float = 0.1
    epochs: int = 10
    max_steps: int | None = None
    seed: int = 0
    stride: int | None = None
    val_fraction: float = 0.2
    data_on_device: bool = False
    checkpoint_steps: int | None = None
    checkpoint_minutes: float | None = None
    val_batch_size: int | None = None
    variant: Literal["spec", "auto"] = "spec"
    report_to: tuple[Reporter, ...] = ("tensorboard",)
    model: Literal["regressor", "lm"] = "regressor"
    lm_config: str | None = None
    text: str = "stdlib"
    batching: Literal["budget", "buckets"] = "budget"
    buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.batch_size is None or self.batch_size >= 1, "batch_size must be >= 1"),
            (self.batch_size_min >= 1, "batch_size_min must be >= 1"),
            (self.effective_batch_size is None or self.effective_batch_size >= 1, "effective_batch_size must be >= 1"),
            (self.effective_batch_size is None or self.effective_batch_size < 1
             or self.effective_batch_size >= self.batch_size_min,
             f"{word('effective_batch_size')} {self.effective_batch_size} is below {word('batch_size_min')} "
             f"{self.batch_size_min}: no micro-batch of at least {self.batch_size_min} samples makes "
             f"{self.effective_batch_size} per optimizer step; raise the one or lower the other"),
            (math.isfinite(self.lr) and self.lr > 0, f"lr must be a finite number > 0, got {self.lr}"),
            (self.lr_scaling in LR_SCALINGS, f"lr_scaling must be one of {', '.join(LR_SCALINGS)}"),
            (self.size_for in SIZE_FORS, f"size_for must be one of {', '.join(SIZE_FORS)}"),
            (self.reference_batch_size >= 1, "reference_batch_size must be >= 1"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             f"weight_decay must be a finite number >= 0, got {self.weight_decay}"),
            (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0,
             f"max_grad_norm must be a finite number > 0, got {self.max_grad_norm}"),
            (self.warmup_steps is None or self.warmup_steps >= 0, "warmup_steps must be >= 0"),
            (math.isfinite(self.min_lr_fraction) and 0 <= self.min_lr_fraction <= 1,
             "min_lr_fraction must be in [0, 1]"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1"),
            (self.stride is None or self.stride >= 1, "stride must be >= 1"),
            (0 < self.val_fraction < 1, "val_fraction must be in (0, 1)"),
            (self.checkpoint_steps is None or self.checkpoint_steps >= 1, "checkpoint_steps must be >= 1"),
            (self.val_batch_size is None or self.val_batch_size >= 1, "val_batch_size must be >= 1"),
            (self.checkpoint_minutes is None
             or (math.isfinite(self.checkpoint_minutes) and self.checkpoint_minutes > 0),
             f"checkpoint_minutes must be a finite number > 0, got {self.checkpoint_minutes}"),
            (self.model in MODELS, f"model must be one of {', '.join(MODELS)}, got {self.model!r}"),
            (self.batching in BATCHINGS, f"batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}"),
            (not self.documents or self.lm_config is not None,
             "--model lm needs its Mamba2Config: --model-arg config=FILE (e.g. configs/mamba2-lm-tiny.json)"),
            (all(b >= 1 for b in self.buckets), f"buckets must be lengths >= 1, got {list(self.buckets)}"),
            (set(self.report_to) <= set(REPORT_TO) and len(set(self.report_to)) == len(self.report_to),
             f"report_to must name each of {', '.join(REPORT_TO)} at most once, got {list(self.report_to)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def documents(self) -> bool:
        """Whether the run trains on documents of every length (:func:`trains_documents`)."""
        return trains_documents(self.model)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["spec"] = self.spec.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a dict of option names (spec fields flat or under ``spec``), every value typed and ranged first
        (:data:`CONFIG_RANGES`, :mod:`vramcal.schema`).

        Raises:
            ConfigError: unknown names, or a value of the wrong kind or out of range (naming the setting).
        """
        data = dict(data)
        if str(data.get("batch_size", "")).lower() == "auto":  # as on the command line; TOML has no null
            data["batch_size"] = None
        spec_names = {f.name for f in dataclasses.fields(RegressorSpec)}
        nested = data.pop("spec", None)
        if nested is not None and not isinstance(nested, dict):
            raise ConfigError(f"spec = {nested!r:.60} is not a table of model settings (d_model, n_layers, ...)")
        spec_values = {f"spec.{k}": v for k, v in (nested or {}).items()}
        spec_values.update({k: data.pop(k) for k in list(data) if k in spec_names})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted({k.removeprefix("spec.") for k in spec_values} - spec_names | set(data) - names)
        if unknown:
            known = ", ".join(sorted(names | spec_names))
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {known}")
        try:
            spec = RegressorSpec(**_typed(RegressorSpec, spec_values))
            return cls(spec=spec, **_typed(cls, data))
        except SchemaError as error:
            raise ConfigError(str(error)) from None
        except ValueError as error:  # RegressorSpec.validate: names the setting
            raise ConfigError(str(error)) from None

    def size_request(self) -> SizeRequest:
        """What this run asks of its profile (:class:`vramcal.sizing.SizeRequest`)."""
        return SizeRequest(batch_size_min=self.batch_size_min, request=self.batch_size,
                           effective_batch_size=self.effective_batch_size, size_for=self.size_for,
                           seq_len=self.spec.seq_len)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``; spec fields (``d_model=...``) go into the spec."""
        spec_names = {f.name for f in dataclasses.fields(RegressorSpec)}
        spec_changes = {k: changes.pop(k) for k in list(changes) if k in spec_names}
        if spec_changes:
            changes["spec"] = dataclasses.replace(changes.get("spec", self.spec), **spec_changes)
        return dataclasses.replace(self, **changes)

    def data_options(self) -> dict[str, Any]:
        """The regressor factory's data options (:data:`vramcal.models.registry.DATA_OPTIONS`), the bar file made
        absolute for the worker."""
        return {"data": str(Path(self.data).resolve()), "stride": self.stride, "val_fraction": self.val_fraction,
                "data_on_device": self.data_on_device}

    def with_absolute_paths(self) -> TrainConfig:
        """A copy whose paths (``data``, ``profiles_dir``, a ``profile`` file, ...) are absolute."""
        profile = self.profile if self.profile == "auto" else str(Path(self.profile).resolve())
        text = self.text if self.text == "stdlib" else str(Path(self.text).resolve())
        lm_config = self.lm_config and str(Path(self.lm_config).resolve())
        return dataclasses.replace(self, data=str(Path(self.data).resolve()),
                                   profiles_dir=str(Path(self.profiles_dir).resolve()), profile=profile, text=text,
                                   lm_config=lm_config)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


# The ranges of the settings' numbers (their types are the annotations); the rest is checked in __post_init__.
CONFIG_RANGES = {
    "batch_size": AT_LEAST_ONE, "batch_size_min": AT_LEAST_ONE, "effective_batch_size": AT_LEAST_ONE, "lr": POSITIVE,
    "reference_batch_size": AT_LEAST_ONE,
    "weight_decay": NON_NEGATIVE, "max_grad_norm": POSITIVE, "warmup_steps": NON_NEGATIVE,
    "min_lr_fraction": FRACTION, "epochs": AT_LEAST_ONE, "max_steps": AT_LEAST_ONE, "seed": Range(0, 2**32 - 1),
    "stride": AT_LEAST_ONE, "val_fraction": Range(0, 1, low_open=True, high_open=True),
    "checkpoint_steps": AT_LEAST_ONE, "checkpoint_minutes": POSITIVE,
    **dict.fromkeys(("d_model", "n_layers", "d_state", "headdim", "expand", "chunk_size", "seq_len", "n_features",
                     "d_conv", "n_groups"), AT_LEAST_ONE),
}
PATHS = ("data", "profile", "profiles_dir", "text")  # file and folder names: non-empty text


def _typed(record: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (keys may carry ``spec.``) typed and ranged (:data:`CONFIG_RANGES`); raises SchemaError naming the
    first misfit."""
    import typing

    hints, typed = typing.get_type_hints(record), {}
    for path, value in values.items():
        name = path.removeprefix("spec.")
        if name == "gpu" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = str(value)  # --gpu 0, written as a number
        typed[name] = read_value(value, hints[name], path, CONFIG_RANGES.get(name))
        if name in PATHS + ("gpu",) and not typed[name].strip():
            raise SchemaError(path, f"{path} is empty: give a {'device' if name == 'gpu' else 'path'}")
        if name == "implementation" and value not in IMPLEMENTATIONS:
            raise SchemaError(path, f"{path} = {value!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    return typed


def load_config(path: Path | str) -> TrainConfig:
    """Read a ``.json`` or ``.toml`` config file (in TOML a ``[train]`` table too).

    Raises:
        ConfigError: the file is missing, unreadable, not JSON/TOML, or holds unknown settings.
    """
    path = Path(path)
    fix = "fix it in the file, or give the option on the command line"
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as editors on Windows write, left out
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text: name a JSON or TOML file of settings") from None
    except OSError as error:
        raise ConfigError(f"config {path}: {error.strerror or error}: name a readable JSON or TOML file") from None
    if not text.strip():
        raise ConfigError(f"config {path} is empty: write settings in it (e.g. {{\"lr\": 1e-4}}), or leave out "
                          f"--config")
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
            data = data.get("train", data)
        else:
            data = json.loads(text)
    except ValueError as error:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise ConfigError(f"config {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: "
                          f"{' '.join(str(error).split())}") from None
    except RecursionError:
        raise ConfigError(f"config {path} is nested too deeply to be a table of settings") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must hold a table of settings, not {type(data).__name__}")
    try:
        return TrainConfig.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"config {path}: {error}; {fix}") from None
