"""The Hugging Face Trainer and Accelerate integrations on the CPU, with real transformers and accelerate objects
and a tiny real Mamba-2 language model; the plain-PyTorch pattern they share (FrameworkRun)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_lightning import profile_here

from vramcal.profile import load_profile, save_profile
from vramcal.sizing import SizingError, accumulation

MIB = 2**20
TINY = Path(__file__).resolve().parents[1] / "configs" / "mamba2-lm-tiny.json"


def tiny_lm():
    from vramcal.models.lm import mamba2_config, read_config
    from vramcal.models.mamba2 import import_transformers_mamba2

    torch.manual_seed(0)
    return import_transformers_mamba2().Mamba2ForCausalLM(mamba2_config(read_config(str(TINY))))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq_len: int = 32, vocab: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def test_accumulation_keeps_the_effective_batch():
    assert accumulation(256, 100) == (86, 3)  # 3 steps of 86 (the last 84): the fewest steps
    assert accumulation(256, 100, exact=True) == (64, 4)  # the largest micro-batch dividing 256
    assert accumulation(60, 100) == (60, 1)
    assert accumulation(97, 10, exact=True) == (1, 97)  # a prime: only 1 divides it
    with pytest.raises(SizingError):
        accumulation(0, 10)


def test_hf_trainer_is_sized_checked_and_recorded(tmp_path):
    from transformers import Trainer, TrainingArguments

    from vramcal.integrations.hf import VramcalCallback

    profile = profile_here()
    path = save_profile(profile, tmp_path / "host.json")
    callback = VramcalCallback(path)
    args = callback.sized(TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, use_cpu=True,
                                            report_to=[], save_strategy="no", logging_strategy="no",
                                            disable_tqdm=True), effective_batch_size=128)
    s = callback.run.sizing
    assert args.per_device_train_batch_size == s.batch_size and 128 % s.batch_size == 0  # exact: a divisor
    assert args.gradient_accumulation_steps * args.per_device_train_batch_size == 128
    assert s.batch_size <= profile_here().limits.conservative_batch_size
    trainer = Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(), callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.state.global_step == 3
    assert callback.report.startswith("vramcal: peak ") and "process term" in callback.report
    observed = load_profile(path).observations[-1]
    assert observed.framework == "transformers.Trainer" and observed.steps == 3
    assert observed.process_delta_bytes == callback.run.held_bytes - profile.held_bytes  # credited, less or more


def test_hf_trainer_starts_its_loop_again_when_its_batch_no_longer_fits(tmp_path, capfd):
    """The trials held 10 MiB: this process holds far more, so the size given no longer fits when training
    begins; the Trainer's training loop starts again at the size that does, as auto_find_batch_size restarts it,
    and one line says so. A callback that found no Trainer (its hook called by hand) stops with the size instead."""
    from transformers import Trainer, TrainingArguments

    from vramcal.integrations.hf import VramcalCallback

    callback = VramcalCallback(profile_here(held_bytes=10 * MIB), limit="safe")
    args = callback.sized(TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, use_cpu=True,
                                            report_to=[], save_strategy="no", disable_tqdm=True))
    given = args.per_device_train_batch_size
    trainer = Trainer(model=tiny_lm(), args=args, train_dataset=Tokens(n=4096), callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    s = callback.run.sizing
    assert trainer.state.global_step == 1 and trainer.args.per_device_train_batch_size == s.batch_size < given
    assert f"vramcal: per_device_train_batch_size {given} no longer fits with what this process holds (the process " \
           f"term, +" in capfd.readouterr().err
    unguarded = VramcalCallback(profile_here(held_bytes=10 * MIB), limit="safe")
    unguarded.sized(args)
    with pytest.raises(SizingError, match=r"^per_device_train_batch_size \d+ no longer fits .* at most \d+$"):
        unguarded.on_train_begin(dataclasses.replace(args, per_device_train_batch_size=given), None, None,
                                 model=tiny_lm())


def test_accelerate_loop_is_sized_checked_and_recorded(tmp_path):
    from accelerate import Accelerator

    from vramcal.integrations.accelerate import measured, sized

    path = save_profile(profile_here(), tmp_path / "host.json")
    accelerator = Accelerator(cpu=True)
    model = tiny_lm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = sized(accelerator, path, effective_batch_size=100)
    assert accelerator.gradient_accumulation_steps == run.sizing.accumulation_steps > 1
    loader = accelerator.prepare(torch.utils.data.DataLoader(Tokens(), batch_size=run.sizing.batch_size))
    with measured(run, accelerator, run_dir=str(tmp_path)) as steps:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
            steps.done += 1
    assert steps.report.startswith("vramcal: peak ") and run.peak_bytes > 0
    observed = load_profile(path).observations[-1]
    assert observed.framework == "accelerate" and observed.steps == steps.done > 0


def test_a_plain_loop_uses_the_run_directly(tmp_path):
    """The plain-PyTorch pattern of the README: size at the start of training, report at the end."""
    from vramcal.integrations.run import FrameworkRun

    path = save_profile(profile_here(verify=False), tmp_path / "host.json")
    with pytest.warns(UserWarning, match="not verified by real trials"):
        run = FrameworkRun(path, device="cpu")
        model = tiny_lm()
        batch_size = run.start().batch_size
    optimizer = torch.optim.AdamW(model.parameters())
    ids = Tokens(n=batch_size).ids
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    line, _ = run.finish(steps=1)
    assert line.startswith("vramcal: peak ") and f"at batch_size {batch_size}:" in line
    with pytest.raises(RuntimeError, match=r"finish\(\) before start\(\)"):
        FrameworkRun(path, device="cpu").finish()


def test_sizing_a_run_adds_little_to_the_process_it_measures(tmp_path):
    """Loading and sizing refit the profile: in Python floats, not through BLAS, whose first call maps
    OpenBLAS's 32 MiB buffer into the data segment, which the process term would then count against the
    trials' processes (a fresh process: this one's OpenBLAS is awake already; the modules imported first). start()
    caches thread stacks on purpose (:func:`vramcal.environment.cache_thread_stacks`): two are cached here first,
    their threads alive together and then gone, so start()'s threads reuse them and only sizing's growth counts."""
    import subprocess
    import sys

    path = save_profile(profile_here(), tmp_path / "host.json")
    script = ("import os, threading, time, torch, numpy, scipy.stats\n"
              "from vramcal.integrations.run import FrameworkRun\n"
              "from vramcal.measure.meters import read_status_bytes\n"
              "tasks, gate = len(os.listdir('/proc/self/task')), threading.Event()\n"
              "threads = [threading.Thread(target=gate.wait) for _ in range(2)]\n"
              "[t.start() for t in threads], gate.set(), [t.join() for t in threads]\n"
              "while len(os.listdir('/proc/self/task')) > tasks:\n"
              "    time.sleep(0.01)  # their stacks are free for reuse once the threads are gone\n"
              "before = read_status_bytes('VmData')\n"
              f"FrameworkRun({str(path)!r}, device='cpu').start()\n"
              "print(read_status_bytes('VmData') - before)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert 0 <= int(done.stdout.split()[-1]) < 8 * MIB, done.stdout


def test_a_framework_process_gets_the_trials_malloc_on_the_host():
    """glibc's default mmap threshold rises when a mapped block is freed, and the next 5 MiB blocks stay in the
    heap after their free; with the trials' settings (set by FrameworkRun.start on the host) they go back. A
    fresh process each: the setting is the process's."""
    import subprocess
    import sys

    script = ("import ctypes, sys\n"
              "from vramcal.environment import set_host_malloc\n"
              "from vramcal.measure.meters import read_status_bytes\n"
              "done = set_host_malloc() if sys.argv[1] == 'set' else None\n"
              "libc = ctypes.CDLL(None)\n"
              "libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]\n"
              "before = read_status_bytes('VmData')\n"
              "for _ in range(3):\n"
              "    block = libc.malloc(5 * 2**20)\n"
              "    ctypes.memset(block, 1, 5 * 2**20)\n"
              "    libc.free(block)\n"
              "print(done, read_status_bytes('VmData') - before)")

    def run(mode: str, **env: str) -> list[str]:
        import os

        base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # a worker pool here set it
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60,
                              check=True, env={**base, **env})
        return done.stdout.rsplit(None, 1)

    from vramcal.environment import HOST_MALLOC

    assert int(run("default")[1]) >= 4 * MIB
    said, kept = run("set")
    assert said == "mmap_threshold 262144, trim_threshold 262144, arena_max 1" and int(kept) < MIB
    assert run("set", GLIBC_TUNABLES=HOST_MALLOC)[0] == "None"  # started with them: nothing to set or say


def test_the_callbacks_give_the_process_arrows_system_pool_and_leave_a_callers_choice(tmp_path):
    """Arrow's default pool (mimalloc) reserves a 1 GiB mapping, counted by the host's meter, when a thread other
    than the main one first reads data (a Lightning FSDP rank builds its model so: +1.14 GiB a rank, and no batch
    fit). The callback, made before the fit, gives the process the system pool the trials' workers have; a pool the
    process was started with stays. A fresh process each, with the thread's read measured."""
    script = ("import sys, threading\n"
              "import pyarrow\n"
              "from vramcal.integrations.lightning import VramcalBatchSize\n"
              "from vramcal.measure.meters import read_status_bytes\n"
              "VramcalBatchSize(sys.argv[1])\n"
              "before = read_status_bytes('VmData')\n"
              "read = threading.Thread(target=lambda: pyarrow.array(range(2**16)))\n"
              "read.start()\n"
              "read.join()\n"
              "print(pyarrow.default_memory_pool().backend_name, read_status_bytes('VmData') - before)\n")
    path = tmp_path / "host.json"
    save_profile(profile_here(), path)
    base = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}  # a worker pool here set it

    def run(**env: str) -> tuple[str, int]:
        done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                              timeout=120, check=True, env={**base, **env})
        backend, grown = done.stdout.split()[-2:]
        return backend, int(grown)

    backend, grown = run()
    assert backend == "system" and grown < 64 * MIB, (backend, grown)
    backend, grown = run(ARROW_DEFAULT_MEMORY_POOL="mimalloc")  # the caller's choice, and what it costs
    assert backend == "mimalloc" and grown > 512 * MIB, (backend, grown)


def test_the_profile_lookups_notices_go_to_the_runs_warn_not_to_every_rank(tmp_path):
    """The lookup's notices (here: the profile was made under other software) went through a module-level warning
    while the run's own went to ``warn``, so under Lightning every rank printed them; now both go to ``warn``."""
    from vramcal.integrations.run import FrameworkRun
    from vramcal.profile import profile_path

    profile = profile_here()
    save_profile(profile, profile_path(tmp_path / "profiles", profile.device, profile.model, "transformers"))
    seen: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reaches Python's warnings
        FrameworkRun(model="regressor", params={}, profiles_dir=tmp_path / "profiles", device="cpu", warn=seen.append)
    assert any("was made with other software or settings that can move memory" in line for line in seen), seen


def test_the_malloc_settings_follow_the_environment_the_process_started_with():
    """Starting the trials' workers sets GLIBC_TUNABLES in this process's os.environ for the children; a process
    that calibrated and then trained took that for its own start and skipped the settings (seen: +5.5 % over the
    prediction in examples/plain_pytorch_train.py's first run). Started with the tunables, nothing is needed."""
    from vramcal.environment import HOST_MALLOC

    script = ("import os\n"
              "from vramcal.environment import HOST_MALLOC, set_host_malloc\n"
              "os.environ['GLIBC_TUNABLES'] = HOST_MALLOC  # as Workers() sets it for the trials\n"
              "print(set_host_malloc())\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    late = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert late.stdout.strip().startswith("mmap_threshold"), late.stdout
    started = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**env, "GLIBC_TUNABLES": HOST_MALLOC})
    assert started.stdout.strip() == "None"


def test_a_runs_information_and_its_warnings_go_their_own_ways():
    """issue 42 item 7: the process term reached people as a UserWarning; information now goes to ``inform`` (a
    line on stderr by default, Lightning's info log), warnings (limits not verified) to ``warn``."""
    from vramcal.integrations.run import FrameworkRun

    told, warned = [], []
    run = FrameworkRun(profile_here(verify=False), device="cpu", warn=warned.append, inform=told.append)
    run.start()
    run.close()
    assert any("a process term of " in line for line in told), told
    assert not any("process term" in line for line in warned), warned
    assert any("not verified by real trials" in line for line in warned), warned
    assert not any("not verified" in line for line in told), told


@pytest.fixture
def two_budgets(tmp_path):
    """The regressor's profile of this host at 8 GiB and at 6 GiB, in one profiles folder (issue 42 item 10: the
    integrations took the newest in silence)."""
    import dataclasses

    from vramcal.profile import profile_path

    folder, paths = tmp_path / "profiles", {}
    for gib, created in ((8, "2025-01-02T03:04:05Z"), (6, "2025-01-01T03:04:05Z")):  # the 8 GiB one is the newest
        profile = dataclasses.replace(profile_here(total_bytes=gib * 2**30), created_utc=created)
        paths[gib] = save_profile(profile, profile_path(folder, profile.device, profile.model, "transformers"))
    assert paths[8] != paths[6]
    return folder, paths


def test_several_budgets_are_chosen_by_capacity_or_refused_with_the_list(two_budgets):
    import vramcal
    from vramcal.integrations.run import FrameworkRun
    from vramcal.sizing.lookup import SeveralBudgetsError

    folder, paths = two_budgets
    find = {"model": "regressor", "params": {}, "profiles_dir": folder}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the profiles were made under other software)
        with pytest.raises(SeveralBudgetsError) as refused:
            FrameworkRun(**find, device="cpu")
        line = str(refused.value)
        assert "\n" not in line and "calibrated at 2 budgets" in line and "give capacity_bytes= (one of 6.00GiB, " \
               "8.00GiB) to choose" in line and "--" not in line, line
        assert f"{paths[8]} (8.00 GiB)" in line and f"{paths[6]} (6.00 GiB)" in line
        with pytest.raises(SeveralBudgetsError, match="give capacity_bytes="):
            vramcal.find_profile("regressor", {}, gpu="none", profiles_dir=folder)
        assert FrameworkRun(**find, device="cpu", capacity_bytes="6GiB").path == paths[6]
        assert FrameworkRun(**find, device="cpu", capacity_bytes=8 * 2**30).path == paths[8]
        assert vramcal.find_profile("regressor", {}, gpu="none", capacity_bytes="6GiB",
                                    profiles_dir=folder).path == paths[6]
        with pytest.raises(SizingError, match=r"no profile for .* at 7.00 GiB"):
            FrameworkRun(**find, device="cpu", capacity_bytes="7GiB")


def test_each_integration_takes_the_budget_to_choose_by(two_budgets, tmp_path):
    from accelerate import Accelerator
    from transformers import TrainingArguments

    from vramcal.integrations.accelerate import sized
    from vramcal.integrations.hf import VramcalCallback

    folder, paths = two_budgets
    find = {"model": "regressor", "params": {}, "profiles_dir": folder}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback = VramcalCallback(**find, capacity_bytes="6GiB")
        callback.sized(TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[]))
        assert callback.run.path == paths[6]
        run = sized(Accelerator(cpu=True), **find, capacity_bytes="6GiB")
        run.close()
        assert run.path == paths[6]
