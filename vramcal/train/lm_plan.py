"""Planning a language-model run (``vramcal train --model lm``): text, profile, batches, the worst batch.

The run trains the ``lm`` family on documents of every length in the batches a profile over several lengths gives
(:class:`vramcal.sizing.sampler.LengthBatchSampler`), sized at its worst batch, at ``--lr`` as given, in one process:
DESIGN.md "A language model on real text"."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from vramcal.calibration.lengths import Bucket, TokenBudget, padded_length
from vramcal.calibration.surface import INTERPOLATED
from vramcal.measure.device import free_bytes
from vramcal.models import lm
from vramcal.models.corpus import BYTE_VOCAB, Corpus, CorpusError, binary_notice, lengths, load_corpus
from vramcal.models.registry import family_of, model_ref
from vramcal.profile import Profile
from vramcal.records import Device
from vramcal.sizing import SizeRequest, Sizing, SizingError, basis_notice, batching, size
from vramcal.sizing.lookup import NoProfileError
from vramcal.train import checkpoint, tracking
from vramcal.train.config import ConfigError, TrainConfig
from vramcal.train.plan import Plan, Setting, host_limit, located_profile, resumed, run_device
from vramcal.words import Info
from vramcal.workload import ModelRef


def lm_ref(config: TrainConfig, device: Device) -> ModelRef:
    """The key of the run's language model over several lengths (no seq_len).

    Raises:
        ValueError: a config transformers refuses or whose vocabulary cannot hold the 256 byte values; a dtype the
            device cannot run.
    """
    settings = lm.read_config(config.lm_config)
    built = lm.mamba2_config(settings, str(config.lm_config))
    if built.vocab_size < BYTE_VOCAB:
        raise ConfigError(f"{config.lm_config}: vocab_size {built.vocab_size} cannot hold the {BYTE_VOCAB} byte values "
                          f"the text is tokenized into: give a config with vocab_size >= {BYTE_VOCAB}")
    params = {"config": config.lm_config, "seq_len": built.chunk_size, "dtype": config.spec.dtype}
    return model_ref("lm", params, device=device, implementation=config.implementation).without("seq_len")


def resolve(config: TrainConfig, capacity_bytes: int | None = None) -> Setting:
    """What a language-model run is sized against: device, model, profile over several lengths, text (cut to the
    profile's longest length) and host budget.

    Raises:
        CorpusError: no text. SizingError: no profile, or one of one length.
        ConfigError, ValueError, DeviceError: as :func:`vramcal.train.plan.resolve`.
    """
    tracking.check_reporters(config.report_to)
    device, notices = run_device(config, capacity_bytes)
    model = lm_ref(config, device)
    profile, path = _profile(config, device, model, capacity_bytes, notices)
    context = max(profile.surface.seq_lens)
    corpus = load_corpus(config.text, context, config.val_fraction)
    notices += [line for line in [binary_notice(corpus)] if line]  # a warning: files the user named, left out
    if corpus.cut:
        notices.append(Info(f"{corpus.cut} of {corpus.documents} documents are longer than the profile's longest "
                            f"seq_len {context} (the longest has {corpus.longest_document} tokens): each is cut into "
                            f"windows of {context} tokens"))
    limit = host_limit(device, profile, capacity_bytes, notices)
    pool = corpus.held_bytes if device.kind.holds_data else 0  # the documents stay in host memory
    return Setting(config, device, model, profile, path, corpus.stats(), pool, limit, tuple(notices))


def _profile(config: TrainConfig, device: Device, model: ModelRef, capacity_bytes: int | None,
             notices: list[str]) -> tuple[Profile, str]:
    """The run's profile over several lengths and its file; SizingError: none, or one of one length."""
    try:
        located = located_profile(config, device, model, capacity_bytes, None, False, False, notices)
    except NoProfileError as error:
        raise SizingError(str(error).replace("<its lengths>", "64:1024")) from None
    if located.profile.surface is None:
        raise SizingError(f"{located.path}: the profile was calibrated at one seq_len; documents of every length need "
                          f"several: `vramcal probe --model lm --model-arg config={config.lm_config} --seq-len "
                          f"64:1024` (shortest:longest)")
    return located.profile, str(located.path)


def batching_record(profile: Profile, config: TrainConfig) -> tuple[dict[str, Any], batching.Worst]:
    """The run's batching as its record keeps it (``{"mode": "budget", "budget": {...}}`` or ``{"mode": "buckets",
    "buckets": [...]}``: a resume forms the same batches), and the worst case it is held to.

    Raises:
        SizingError: a bucket above the profile's longest seq_len; no budget fits one longest document.
    """
    if config.batching == "budget":
        budget, (_, worst) = batching.budget(profile)
        return {"mode": "budget", "budget": budget.to_dict()}, worst
    buckets, worst = batching.buckets(profile, config.buckets)
    return {"mode": "buckets", "buckets": [b.to_dict() for b in buckets]}, worst


def sampler(record: dict[str, Any], lengths: list[int], **options: Any):
    """The :class:`vramcal.sizing.sampler.LengthBatchSampler` of a batching record.

    Raises:
        ValueError: a length no bucket covers, or above the budget's longest (one line naming the document).
    """
    from vramcal.sizing.sampler import LengthBatchSampler  # loads torch: only when called

    if record["mode"] == "budget":
        return LengthBatchSampler(lengths, budget=TokenBudget.from_dict(record["budget"]), **options)
    return LengthBatchSampler(lengths, buckets=[Bucket.from_dict(b) for b in record["buckets"]], **options)


def shapes(batches: list[list[int]], lengths: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """Each batch's (documents, longest length padded to ``chunk_size``)."""
    return [(len(b), padded_length(max(lengths[i] for i in b), chunk_size)) for b in batches]


def plan_run(config: TrainConfig, run_dir: Path, setting: Setting) -> Plan:
    """A new language-model run against ``setting``, sized at the batch whose upper bound is highest (an epoch's
    batch shapes do not depend on its shuffle, so they are formed once).

    Raises:
        SizingError: a length the batching cannot hold, or the worst batch above the profile's safe limit now.
        RunDirError: as :func:`vramcal.train.plan.plan_run`.
    """
    checkpoint.check_run_dir(run_dir, resume=False)
    profile, stats = setting.profile, dict(setting.data_stats)
    corpus = load_corpus(config.text, int(stats["context"]), config.val_fraction)
    record, held_to = batching_record(profile, config)
    chunk = family_of(profile.model).chunk_size(profile.model.replace(seq_len=1))
    formed = {}
    for side, docs in (("train", corpus.train), ("val", corpus.val)):
        try:
            formed[side] = shapes(sampler(record, lengths(docs), shuffle=False).batches(), lengths(docs), chunk)
        except ValueError as error:
            raise SizingError(f"--text {config.text}, {side}: {error}") from None
    fit = profile.surface.fit
    worst = max(formed["train"], key=lambda shape: fit.upper(shape[0], max(shape[1], min(profile.surface.seq_lens))))
    free, source = free_bytes(setting.device)
    sizing = size(profile, SizeRequest(request=worst[0], seq_len=max(worst[1], min(profile.surface.seq_lens))),
                  pool_data_bytes=setting.pool_data_bytes, free_bytes=free, free_source=source)
    if sizing.batch_size < worst[0]:
        raise SizingError(f"the worst batch, {worst[0]} documents of up to {worst[1]} tokens, is above the profile's "
                          f"safe limit at that length now ({sizing.safe_batch_size}: {'; '.join(sizing.notices)}): "
                          f"free memory, or calibrate again")
    notices = (*setting.notices, *_batching_notices(held_to, sizing))
    stats.update(batching=record, chunk_size=chunk, worst={"batch_size": worst[0], "seq_len": worst[1]},
                 **_totals(formed))
    checkpoint.prepare_run_dir(run_dir, resume=False)
    return Plan(config=config, run_dir=Path(run_dir), device=setting.device, model=setting.model, sizing=sizing,
                profile_path=setting.profile_path, lr=config.lr, data_stats=stats,
                host_memory_limit_bytes=setting.host_memory_limit_bytes,
                notices=notices)


def _batching_notices(worst: batching.Worst, sizing: Sizing) -> tuple[str, ...]:
    """The sizing's notices, the real trial that verified the batching's worst case said in place of interpolation."""
    if worst.check is None:
        return sizing.notices
    said = Info(f"every batch lies within {worst.what}, verified by a real trial at batch_size {worst.batch_size} x "
                f"seq_len {worst.seq_len}")
    return (*(n for n in sizing.notices if n != basis_notice(INTERPOLATED)), said)


def _totals(formed: dict[str, list[tuple[int, int]]]) -> dict[str, int]:
    """Each side's batches and tokens held, padding included (the forecast's terms)."""
    totals = {}
    for side, each in formed.items():
        totals[f"{side}_batches"] = len(each)
        totals[f"{side}_padded_tokens"] = sum(b * n for b, n in each)
    totals["largest_batch"] = max(b for b, _ in formed["train"] + formed["val"])
    return totals


def plan_resume(run_dir: Path, overrides: dict[str, Any]) -> Plan:
    """The continuation of the language-model run in ``run_dir`` (as :func:`vramcal.train.plan.plan_resume`; the
    worker checks the text).

    Raises:
        RunDirError: nothing to resume. DeviceError: the device is not here.
    """
    plan, config = resumed(run_dir, overrides, "the batches stay")
    return replace(plan, lr=config.lr)


def read_corpus(plan: Plan) -> Corpus:
    """The plan's text, read again in the training process.

    Raises:
        CorpusError: the text is gone, or is not the text the run was planned on (nothing is trained on it).
    """
    stats = plan.data_stats
    corpus = load_corpus(plan.config.text, int(stats["context"]), plan.config.val_fraction)
    if corpus.identity != stats["identity"]:
        raise CorpusError(f"--text {plan.config.text} is not the text this run was planned on ({stats['files']} files, "
                          f"SHA-256 {stats['identity'][:12]}...; now {corpus.files} files, {corpus.identity[:12]}...): "
                          f"nothing was trained on it; train on the same text, or start a new run")
    return corpus
