"""``vramcal train --nproc-per-node N``: a DDP (or ``--strategy fsdp``) run launched through torchrun's elastic agent
(DESIGN.md "Several processes: DDP and FSDP").

The launcher (:func:`launch`) writes ``<run_dir>/launch.json`` and starts the agent, which starts one rank process
per local rank (:func:`main`): each finds its own device and world profile, sizes its own batch, trains in a worker
forked like the trials (:func:`vramcal.train.worker.train_in_worker`) and records its own observation. A failed rank
writes one line to ``<run_dir>/ranks/<rank>.error``; the launcher raises it, the folder left resumable."""

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
    """Start the run's ranks through torchrun's elastic agent and wait for them.

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
    """The host budgets (bytes) a run's ranks were last started with (a ``--resume`` without ``--capacity`` keeps
    them); () when ``launch.json`` is missing, unreadable or names none."""
    try:
        capacities = json.loads((run_dir / LAUNCH).read_text()).get("capacities", [])
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(c for c in capacities if isinstance(c, int) and c > 0)


def launched_ranks(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """How a run was last launched (its local ranks, torchrun's options), for a ``--resume`` that gives neither;
    ``(1, {})`` for a run of one process.

    Raises:
        TrainError: a run launched on several nodes (each node resumes with its own options).
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
    """The world a resumed run keeps (``launch.json``'s strategy and settings) at ``now``'s size and backend; ``now``
    when none is recorded."""
    try:
        saved = json.loads((run_dir / LAUNCH).read_text())["world"]
        return World.from_dict({**saved, "nproc": now.nproc, "backend": now.backend})
    except (OSError, ValueError, KeyError, TypeError):  # (SchemaError is a ValueError)
        return now


@contextlib.contextmanager
def signals_as_before() -> Iterator[None]:
    """Run torchrun's agent with the process's own SIGTERM and Ctrl-C handlers: the agent takes them over and never
    puts them back; its ``SignalException`` is handed to the handler its signal had.

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
    """Give this rank process the ``OMP_NUM_THREADS`` of the command that launched it, for the worker
    server it starts: torchrun's 1 would leave the server ~80 MiB less data segment than the probe's had (measured:
    DESIGN.md "Several processes: DDP and FSDP")."""
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
