"""``vramcal train --nproc-per-node N``: a DDP run (or FSDP, ``--strategy fsdp``) launched through torch.distributed's
own launcher.

The launcher (:func:`launch`, in the ``vramcal train`` process) checks the data and the run folder, writes
the run's settings to ``<run_dir>/launch.json`` and starts torchrun's elastic agent
(``torch.distributed.run``, with ``--nnodes`` and the rendezvous options passed through, so several
machines join as torchrun users already do). The agent starts one *rank process* per local rank
(:func:`main`: ``python -m vramcal.train.distributed``), which:

1. finds its own device (GPU: the ``LOCAL_RANK``-th visible one; the host: its own budget, ``--capacity``
   given once for all or once per local rank) and its own profile, calibrated for this DDP world
   (:func:`vramcal.profile.world_difference` says why another world's or one process's cannot size it);
2. sizes its own batch from that profile (ranks on different cards take different batches);
3. trains in a worker forked from vramcal's server, like the trials that sized it
   (:func:`vramcal.train.worker.train_in_worker`; the server started with the caller's ``OMP_NUM_THREADS``, as the
   probe's was, not torchrun's: :func:`as_the_caller`): the ranks agree on every rank's batch, the learning rate
   follows the global batch, and gradients are weighted by each rank's samples
   (:class:`vramcal.train.loop.Share`); rank 0 writes the run's records, checkpoints and metrics (under FSDP
   every rank gathers the state it saves first: :mod:`vramcal.train.states`);
4. appends its own observation (its measured peak against its own profile's prediction) to its profile.

A rank that fails writes one line to ``<run_dir>/ranks/<rank>.error`` and exits 1; the agent then stops the
others (within its monitor interval and shutdown timeout), and the launcher raises one line naming the
rank. The run folder is left resumable: ``vramcal train --resume --run-dir ... --nproc-per-node N`` (the world's
strategy and settings kept from ``launch.json``: :func:`launched_world`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vramcal.files import atomic_write_json
from vramcal.records import World
from vramcal.train import checkpoint
from vramcal.train.config import TrainConfig, load_config
from vramcal.train.errors import TrainError
from vramcal.words import FLAGS, labelled, speaking

LAUNCH = "launch.json"
RANKS = "ranks"  # <run_dir>/ranks/<rank>.error: a failed rank's one line
OMP = "omp_num_threads"  # launch.json: the caller's OMP_NUM_THREADS (null: unset), which the ranks' servers get


def launch(config: TrainConfig, run_dir: Path, world: World, nproc_per_node: int, torchrun: dict[str, Any],
           capacities: tuple[int, ...] = (), resume: bool = False, overrides: dict[str, Any] | None = None) -> None:
    """Start the run's ranks through torchrun's elastic agent and wait for them (module docstring).

    Args:
        world: the DDP settings; its ``nproc`` is the whole world (nodes × ``nproc_per_node``).
        torchrun: the torchrun options given (``--nnodes``, the rendezvous's), by their argument names.
        capacities: the host budget of every local rank (one value: all alike); () = each profile's own.
        overrides: ``epochs``/``max_steps`` of a resumed run.

    Raises:
        TrainError: a rank failed (one line naming it and the last good checkpoint).
    """
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    atomic_write_json(run_dir / LAUNCH, {"config": config.with_absolute_paths().to_dict(), "world": world.to_dict(),
                                         "capacities": list(capacities), "resume": resume,
                                         "overrides": overrides or {}, "nproc_per_node": nproc_per_node,
                                         "torchrun": torchrun,  # how it was launched: a plain --resume does so again
                                         OMP: os.environ.get("OMP_NUM_THREADS")})  # before torchrun sets it
    args = [f"--nproc-per-node={nproc_per_node}", *(f"--{k.replace('_', '-')}={v}" for k, v in torchrun.items()),
            "-m", "vramcal.train.distributed", str(run_dir / LAUNCH)]
    for name in list(logging.root.manager.loggerDict):  # each module's logger has its own level (elastic's get_logger)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # the agent's own log lines: our one line says it
    caller = os.environ.get("OMP_NUM_THREADS")
    try:
        with signals_as_before():
            run(get_args_parser().parse_args(args))
    except ChildFailedError as error:
        raise TrainError(failure_line(run_dir, error)) from None
    finally:  # torchrun set it in this process too: a later launch (a search's next run) records the caller's
        if caller is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def launched_capacities(run_dir: Path) -> tuple[int, ...]:
    """The host budgets (bytes) a run's ranks were last started with: what ``--resume`` without ``--capacity``
    keeps; () when the run folder's ``launch.json`` is missing, unreadable or named none."""
    try:
        capacities = json.loads((run_dir / LAUNCH).read_text()).get("capacities", [])
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(c for c in capacities if isinstance(c, int) and c > 0)


def launched_ranks(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """How a run was last launched, for a ``--resume`` that gives neither ``--nproc-per-node`` nor torchrun's options:
    its ranks on this machine and torchrun's options (``launch.json``; a record written before they were kept: the
    world's ranks, no options); ``(1, {})`` for a run of one process (no world recorded).

    Raises:
        TrainError: a run launched on several nodes: each node's launch is its own, so it is resumed with its options.
    """
    try:
        launched = json.loads((run_dir / LAUNCH).read_text())
        nproc = int(launched.get("nproc_per_node") or launched["world"]["nproc"])
        torchrun = dict(launched.get("torchrun") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 1, {}
    nodes = str(torchrun.get("nnodes", 1)).rpartition(":")[2]
    if not nodes.isdigit() or int(nodes) > 1:
        raise TrainError(f"{run_dir} was launched on several nodes (--nnodes {torchrun.get('nnodes')}): resume it on "
                         f"each node as it was launched there (--resume with --nproc-per-node {nproc} and the node's "
                         f"torchrun options)")
    return nproc, torchrun


def launched_world(run_dir: Path, now: World) -> World:
    """The world a resumed run keeps: the strategy and settings its ranks were last started with (``launch.json``),
    at ``now``'s size and backend; ``now`` itself when the file is missing, unreadable or names no world."""
    try:
        saved = json.loads((run_dir / LAUNCH).read_text())["world"]
        return World.from_dict({**saved, "nproc": now.nproc, "backend": now.backend})
    except (OSError, ValueError, KeyError, TypeError):  # (SchemaError is a ValueError)
        return now


@contextlib.contextmanager
def signals_as_before() -> Iterator[None]:
    """Run torchrun's agent with the process's own ways out of SIGTERM and Ctrl-C.

    The agent takes over SIGTERM, SIGINT, SIGHUP and SIGQUIT while it runs (its process context's handler raises
    ``SignalException`` after it has stopped the ranks, and is never put back), so a ``kill`` during a run
    ended in torch's traceback. Here the handlers in place before are put back, and a ``SignalException`` is
    handed to the one its signal had: vramcal's command turns SIGTERM into its one line (exit 143), Python's
    SIGINT handler raises KeyboardInterrupt (exit 130); a signal whose handler was not Python's is a
    KeyboardInterrupt.

    Raises:
        KeyboardInterrupt: (or what the signal's own handler raises) the agent was stopped by a signal.
    """
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException  # loads torch: only when called

    if threading.current_thread() is not threading.main_thread():  # the agent takes no signals there either
        yield
        return
    numbers = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]
    before = {number: signal.getsignal(number) for number in numbers}
    try:
        yield
    except SignalException as error:
        for number, handler in before.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        handler = before.get(error.sigval)
        if callable(handler):
            handler(error.sigval, None)
        raise KeyboardInterrupt from None
    finally:
        for number, handler in before.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def failure_line(run_dir: Path, error: Any) -> str:
    """One line for a failed world: the first rank's own line (``ranks/<rank>.error``), or the agent's."""
    lines = sorted((path.stat().st_mtime, path.stem, path.read_text().strip())
                   for path in (run_dir / RANKS).glob("*.error") if path.read_text().strip())
    kept = checkpoint.last_good(run_dir)
    if lines:
        _, rank, line = lines[0]
        return f"rank {rank} failed: {line}; the other ranks were stopped; {kept}"
    ranks = ", ".join(str(failure.local_rank) for failure in getattr(error, "failures", {}).values()) or "?"
    return f"rank {ranks} ended without a result (killed?); the other ranks were stopped; {kept}"


def main(argv: list[str] | None = None) -> None:
    """A rank process (module docstring): plan this rank, train it in a worker, record its observation."""
    from vramcal.train.runner import train  # loads numpy: only when called

    spec_path = Path((argv or sys.argv[1:])[0])
    spec = json.loads(spec_path.read_text())
    as_the_caller(spec)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    run_dir = spec_path.parent
    try:
        with speaking(FLAGS):  # the run was started by `vramcal train`: its lines name that command's flags
            plan, echo = rank_plan(spec, run_dir, rank, local_rank, int(os.environ["WORLD_SIZE"])), _printer(rank)
            for notice in plan.notices:  # what sized rank 0's batch and where, as one process says it
                echo(labelled(notice))
            train(plan, echo=echo)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's process group: the launcher says it
        sys.exit(130)
    except (TrainError, ValueError, OSError, RuntimeError) as error:
        line = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        try:
            (run_dir / RANKS).mkdir(exist_ok=True)
            (run_dir / RANKS / f"{rank}.error").write_text(line + "\n")
        except OSError:
            print(f"rank {rank}: {line}", file=sys.stderr)  # the launcher cannot read it: say it here
        sys.exit(1)


def as_the_caller(spec: dict[str, Any]) -> None:
    """Give this rank process the ``OMP_NUM_THREADS`` of the command that launched it (``launch.json``), for the
    worker server it starts: torchrun sets it to 1 where its caller had none, and a server that imports torch with
    OpenMP's and OpenBLAS's pools at 1 thread holds about 80 MiB less data segment (their threads' stacks and
    buffers, measured on the 2-core host: 398 against 478 MiB) than the probe's server did, which every forked worker
    inherits: the rank then peaked that much under its trials at the same batch (2 FSDP ranks at the ``small`` spec:
    -9.3 % against the prediction, -0.7 % with the caller's setting). The worker's compute threads are the world's
    ``threads_per_rank`` either way (:func:`vramcal.measure.distributed.join`). A ``launch.json`` written before this
    was recorded leaves it as is."""
    if OMP not in spec:
        return
    if spec[OMP] is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = spec[OMP]


def _printer(rank: int):
    """Rank 0 prints what the run says; the others print nothing (their failures go to the error file)."""
    def echo(line: str) -> None:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)

    return echo


def rank_plan(spec: dict[str, Any], run_dir: Path, rank: int, local_rank: int, world_size: int):
    """This rank's :class:`~vramcal.train.plan.Plan`: its device, its profile for the world, its batch size.

    Raises:
        SizingError, DeviceError, DataError, ValueError: one line, naming what this rank could not find.
    """
    from vramcal.train.plan import plan_run, resolve  # loads numpy: only when called

    world = World(**{**spec["world"], "nproc": world_size})
    capacities = tuple(spec["capacities"])
    capacity = capacities[local_rank if len(capacities) > 1 else 0] if capacities else None
    config = TrainConfig.from_dict(spec["config"])
    if spec["resume"]:
        config = load_config(run_dir / checkpoint.CONFIG).replace(**spec["overrides"])
    gpu = str(local_rank) if config.gpu != "none" else "none"
    setting = resolve(config.replace(gpu=gpu), capacity, world=world,
                      budget_matches=len(set(capacities)) > 1, unchecked=True)
    plan = plan_run(config, run_dir, setting, prepare=False, ranks=world_size)
    return dataclasses.replace(plan, world=world, rank=rank, resume=spec["resume"])


if __name__ == "__main__":
    main()
