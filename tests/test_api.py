"""The public API and ``probe --model module:function`` with a user's factory (tests/user_models.py).

Under pytest the tests folder is on ``sys.path`` (pytest puts it there for conftest.py), so the trial
processes, forked from a server that starts with the caller's ``sys.path``, import ``user_models`` too.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from host_budget import budget, capacity

import vramcal
from vramcal.cli import main
from vramcal.measure.device import DeviceError, host_device
from vramcal.models.registry import family_of
from vramcal.profile import load_profile, save_profile

from fakes import DRIVER_NOT_LOADED, install_fake_nvml

PARAMS = {"n_features": 16384, "width": 8}
# 640 MiB of host memory, no reserve: about 100 MiB above a worker's own footprint, 1,500 samples of 64 KiB,
# so the largest trials take a fraction of a second (grown by what this torch build's workers hold beyond the
# CPU build's: tests/host_budget.py)
CAPACITY = 640 * 2**20


def host() -> dict:
    return dict(gpu="none", capacity_bytes=budget(CAPACITY), settings=vramcal.LimitSettings(reserve_bytes=0))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """One real calibration of the user's MLP on 640 MiB of host memory (about 10 trials, 5-15 s), with the
    progress calibrate() prints by default (on stderr)."""
    import contextlib
    import io

    profiles = tmp_path_factory.mktemp("profiles")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        profile = vramcal.calibrate("user_models:mlp", PARAMS, profiles_dir=profiles, **host())
    return profile, profiles, err.getvalue().splitlines()


def test_a_user_factory_calibrates_to_a_verified_profile_that_names_it(calibrated):
    profile, profiles, seen = calibrated
    assert profile.verified, profile.warnings
    assert profile.model.factory == "user_models:mlp" and profile.model.params == PARAMS
    assert family_of(profile.model).name == "factory" and profile.implementation == "factory"
    assert profile.kernel_path.startswith("no Mamba-2 module found (a user model)")
    n_params = 16384 * 8 + 8 + 8 * 8 + 8 + 8 + 1
    # fp32, all trained: parameters, gradients and AdamW's two states (and its step count, a 4-byte tensor for each
    # of the 6 parameters), held whole by one process
    states = 16 * n_params + 6 * 4
    assert profile.model_info == {"n_params": n_params, "gradient_bytes": 4 * n_params, "model_state_bytes": states,
                                  "rank_model_state_bytes": states}
    assert len(profile.trials) >= 5 and len(seen) >= len(profile.trials)  # calibrate()'s default progress
    trial_lines = [line for line in seen if line.startswith("vramcal:  batch_size ")]  # the probe command's lines
    assert [int(line.split()[2]) for line in trial_lines] == [t.batch_size for t in profile.trials]
    assert any(line.split()[3] == "ok" and "[steady, " in line for line in trial_lines)
    # no bar, no terminal: a step is a line only once a minute has passed since the last line (issue 59 item 7: a
    # "step 5/40" line was in every log, of a steady trial that ran 7 steps); this one took seconds
    assert not any("steady trial step" in line for line in seen), seen
    limits = profile.limits
    assert 0 < limits.conservative_batch_size < limits.safe_batch_size
    # the input's 64 KiB per sample dominates (activations of width 8 are 32 B per layer)
    assert 0.95 * 64 * 2**10 <= profile.fit.slope_bytes_per_sample < 1.5 * 64 * 2**10
    saved = list(profiles.glob("**/mlp-factory-*.json"))
    assert len(saved) == 1 and load_profile(saved[0]) == profile and profile.path == saved[0]
    assert saved[0].parent.name == host_device().slug()


def test_find_profile_and_batch_size_read_it_back(calibrated):
    profile, profiles, _ = calibrated
    located = vramcal.locate_profile("user_models:mlp", PARAMS, device=host_device(budget(CAPACITY)),
                                     profiles_dir=profiles)
    found, path = located.profile, located.path
    assert found == profile and located.notices == () and path.name.startswith("mlp-factory-")
    assert vramcal.find_profile("user_models:mlp", PARAMS, gpu="none", capacity_bytes=budget(CAPACITY),
                                profiles_dir=profiles) == profile
    with pytest.raises(TypeError, match=r"returns the Profile itself since vramcal 0.2 .* vramcal.locate_profile"):
        found, path, notices = vramcal.find_profile("user_models:mlp", PARAMS, gpu="none",  # 0.1's tuple
                                                    capacity_bytes=budget(CAPACITY), profiles_dir=profiles)
    limits = profile.limits
    assert vramcal.batch_size(found) == limits.conservative_batch_size
    assert vramcal.batch_size(found, "safe") == limits.safe_batch_size
    assert vramcal.batch_size(found, request=10**9) == limits.safe_batch_size
    assert vramcal.size(found, vramcal.SizeRequest(request=7)).predicted_peak_bytes == int(profile.fit.predict(7))
    with pytest.raises(vramcal.SizingError, match="another model: width=16 \\(the profile's: 8\\)"):
        vramcal.find_profile("user_models:mlp", {**PARAMS, "width": 16}, gpu="none", capacity_bytes=budget(CAPACITY),
                             path=path)
    with pytest.raises(vramcal.SizingError, match=r"no profile for .* `vramcal probe --gpu none --capacity \S+ "
                                                  r"--model user_models:mlp --model-arg n_features=16384 --model-arg "
                                                  r"width=4`"):  # the budget the device was given, too
        vramcal.locate_profile("user_models:mlp", {**PARAMS, "width": 4}, device=host_device(budget(CAPACITY)),
                               profiles_dir=profiles)


@pytest.mark.parametrize("factory, message", [
    ("no_such_module_here:make", "cannot import no_such_module_here for {model}no_such_module_here:make "
                                 "(ModuleNotFoundError: No module named 'no_such_module_here'): check the name "
                                 "and that it is importable: installed, on PYTHONPATH, or (vramcal probe) in the "
                                 "current directory"),
    ("user_models:nope", "user_models has no nope for {model}user_models:nope: name a function that returns "
                         "a vramcal.TrainingStep"),
    ("user_models:not_callable", "{model}user_models:not_callable is not callable"),
    ("user_models", "{model}'user_models' is neither regressor, lm nor module:function"),
])
def test_a_factory_that_cannot_be_called_fails_before_any_trial_in_one_line(factory, message):
    """The API names the argument (``model=``), the command line its flag (``--model``): vramcal.words."""
    with pytest.raises(vramcal.WorkloadError) as error:
        vramcal.calibrate(factory, **host())
    assert str(error.value).startswith(message.format(model="model=")) and "\n" not in str(error.value)
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(2**30), "--model", factory,
                                       "--no-report"])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {message.format(model='--model ')}")
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("factory, message", [
    ("user_models:raises", "raised ValueError: width must be a multiple of 64: fix the step"),
    ("user_models:wrong_type", "the factory user_models:wrong_type returned MLP, not a vramcal.TrainingStep: "
                               "return vramcal.TrainingStep(model=..., optimizer=..., batch=..., loss=...): fix"),
    ("user_models:loss_raises", "before any memory limit: RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                                "(8x16 and 32x16): fix the step"),
])
def test_a_step_that_fails_in_the_first_trial_says_why_in_one_line(factory, message, tmp_path, capsys):
    with pytest.raises(vramcal.CalibrationError):
        vramcal.calibrate(factory, profiles_dir=tmp_path, **host())
    assert capsys.readouterr().err.startswith("vramcal:  batch_size      1  error")  # the default progress
    seen = []
    with pytest.raises(vramcal.CalibrationError) as error:
        vramcal.calibrate(factory, profiles_dir=tmp_path, on_trial=seen.append, progress=False, **host())
    assert capsys.readouterr().err == ""
    text = str(error.value)
    assert text.startswith(f"the training step of {factory} failed in the first trial (batch_size 1)")
    assert message in text and "\n" not in text
    assert "capacity" not in text and "second line" not in text  # not a budget problem; first line only
    assert [t.status for t in seen] == ["error"]  # one trial, then the calibration stops
    assert not list(tmp_path.iterdir())  # no profile written


def test_the_cli_says_it_in_one_line_too(tmp_path):
    result = CliRunner().invoke(main, ["probe", "--gpu", "none", "--capacity", capacity(CAPACITY), "--model",
                                       "user_models:raises", "--model-arg", "width=100", "--out",
                                       str(tmp_path / "p.json"), "--no-report"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert errors == [errors[0]] and "raised ValueError: width must be a multiple of 64: fix" in errors[0]
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("first", [
    "",
    "import vramcal.sizing, vramcal.api",  # the package vramcal.calibration imported before the API
    "from vramcal.integrations.lightning import VramcalBatchSize",
])
def test_vramcal_calibrate_is_the_public_function(first):
    """The package vramcal.calibration shares the name; importing it must not hide the function."""
    code = f"{first}; import vramcal; f = vramcal.calibrate; import vramcal.api; print(f is vramcal.api.calibrate)"
    out = subprocess.run([sys.executable, "-c", code.lstrip("; ")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_model_args_that_are_not_plain_json_are_refused():
    with pytest.raises(vramcal.WorkloadError, match="plain JSON values"):
        vramcal.model_ref("user_models:mlp", {"width": float("nan")}, device=host_device())


def test_the_probe_command_for_a_missing_profile_reads_back_as_the_same_arguments():
    import shlex

    from vramcal.cli.options import KeyValue

    params = {"flag": True, "name": "two words", "sizes": [1, 2], "digits": "3", "lr": 2.5e-4, "cfg": {"a": None}}
    command = vramcal.probe_command(host_device(), vramcal.ModelRef.make("user_models:mlp", params))
    words = shlex.split(command)
    assert words[:5] == ["vramcal", "probe", "--gpu", "none", "--model"] and words[5] == "user_models:mlp"
    given = [words[i + 1] for i, word in enumerate(words) if word == "--model-arg"]
    assert dict(KeyValue().convert(text, None, None) for text in given) == params


def test_the_api_takes_a_capacity_as_the_command_line_does_and_refuses_nonsense_in_its_own_words():
    from vramcal.api import capacity_argument, select_devices

    assert capacity_argument("1.5GiB") == 3 * 2**29 == capacity_argument(3 * 2**29)
    (device,), _ = select_devices("none", "1.5GiB")
    assert device.total_bytes == 3 * 2**29
    for bad, error, words in [(1.5e9, TypeError, "not float"), (True, TypeError, "not bool"),
                              ("lots", ValueError, "cannot read 'lots' as a size"), (0, ValueError, "no budget")]:
        with pytest.raises(error, match=words):
            capacity_argument(bad)


def test_calibrate_says_where_it_saved_the_profile_and_that_auto_chose_the_host(tmp_path, capsys):
    """gpu="auto" on a machine without a GPU calibrates the host: one line says so, as the CLI does, and one
    names the file written. The driver is faked as not loaded, so that on a GPU box too this is the host."""
    install_fake_nvml([], init_error=DRIVER_NOT_LOADED)
    profile = vramcal.calibrate("user_models:mlp", PARAMS, profiles_dir=tmp_path,
                                **{**host(), "gpu": "auto", "capacity_bytes": f"{budget(CAPACITY)}B"})
    err = capsys.readouterr().err
    (saved,) = tmp_path.rglob("*.json")
    assert f"vramcal: profile saved to {saved}" in err
    assert profile.path == saved and vramcal.load_profile(saved).path == saved  # issue 42 item 10: returned too
    assert re.search(r"vramcal: no usable NVIDIA GPU .*: using the host's memory instead", err), err
    assert profile.device.kind == "host"


@pytest.mark.parametrize(("arguments", "error", "words"), [
    ({"request": "8"}, TypeError, "request= takes a whole number, not str '8'"),
    ({"request": 8.5}, TypeError, "request= takes a whole number, not float 8.5"),
    ({"request": True}, TypeError, "not bool True"),
    ({"request": 0}, vramcal.SizingError, "request=0 is below 1"),
    ({"request": -5}, vramcal.SizingError, "request=-5 is below 1"),
    ({"batch_size_min": 0}, vramcal.SizingError, "batch_size_min=0 is below 1"),
    ({"pool_data_bytes": -1}, vramcal.SizingError, "pool_data_bytes=-1 is below 0"),
    ({"seq_len": 0}, vramcal.SizingError, "seq_len=0 is below 1"),
    ({"limit": "foo"}, vramcal.SizingError, "limit='foo' is not a limit: use one of 'conservative', 'safe'"),
])
def test_batch_size_refuses_nonsense_at_its_door_in_python_words(arguments, error, words):
    """issue 43: ``batch_size(profile, 'foo')`` returned the safe size, ``request=8.5`` gave 8.5, ``request=0``
    gave 1: each is refused by the Python parameter's name, never a CLI flag."""
    from profiles_for_tests import host_profile

    limit = arguments.pop("limit", "conservative")
    with pytest.raises(error, match=re.escape(words)):
        vramcal.batch_size(host_profile(), limit, **arguments)


def test_batch_size_reads_a_path_and_refuses_what_is_no_profile(calibrated, tmp_path):
    profile, profiles, _ = calibrated
    (path,) = profiles.rglob("*.json")
    assert vramcal.batch_size(path) == vramcal.batch_size(str(path)) == vramcal.batch_size(profile)
    with pytest.raises(TypeError, match=r"profile= takes a vramcal.Profile, not NoneType None: read a file with"):
        vramcal.batch_size(None)
    with pytest.raises(vramcal.ProfileError, match="does not exist"):
        vramcal.batch_size(tmp_path / "missing.json")


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda: vramcal.find_profile(gpu="bogus"), DeviceError, r"^gpu=bogus: not a device choice"),
    (lambda: vramcal.find_profile(gpu="cpu"), DeviceError, r"the host's memory is gpu=none$"),
    (lambda: vramcal.find_profile("regressor", "d_model=32", gpu="none"), TypeError,
     r"params= takes the model's arguments as a dict"),
    (lambda: vramcal.load_profile(None), TypeError, r"load_profile\(\) takes a profile file's path, not NoneType"),
    (lambda: vramcal.plan_calibration(options={"foo": 1}, device=host_device()), ValueError,
     r"options= has no 'foo': it takes data, stride, val_fraction, data_on_device"),
])
def test_the_api_refuses_in_pythons_words(call, error, words):
    """Issue 43 items 7-8: a wrong type is a TypeError, a wrong value a ValueError (or vramcal's own, derived from
    it), each naming the Python parameter (``gpu=``, never ``--gpu``) in one line."""
    with pytest.raises(error, match=words) as raised:
        call()
    assert "--" not in str(raised.value) and "\n" not in str(raised.value)


def test_answer_names_its_own_arguments_and_refuses_lengths_below_one(tmp_path):
    from test_train import make_profile

    from vramcal.sizing import answer

    profile = make_profile(host_device())
    for kwargs, words in [({}, r"give seq_len= or batch_size= \(one of them\)"),
                          ({"seq_len": -1}, r"seq_len=-1 is below 1"), ({"batch_size": 0}, r"batch_size=0 is below 1")]:
        with pytest.raises(vramcal.SizingError, match=words):
            answer(profile, **kwargs)
    with pytest.raises(TypeError, match="seq_len= takes a whole number, not str"):
        answer(profile, seq_len="32")
    result = CliRunner().invoke(main, ["limits", str(save_profile(profile, tmp_path / "p.json")),
                                       "--seq-len", "0"])
    assert result.exit_code != 0 and "--seq-len" in result.output and "seq_len=" not in result.output


# ------------------------------------------------------------------------------ the front door, walked
#
# issue 43: every public function and class of the API and the integrations, each parameter given each bad value
# of the round that fits it; a wrong type must raise TypeError, a wrong value ValueError (vramcal's own errors
# derive from it), in one line naming the parameter, never a flag, before any work (a trial or a lookup).

BAD: dict[str, list[tuple[object, type]]] = {
    "gpu": [(0.5, TypeError), ("bogus", ValueError), ("cpu", ValueError)],
    "capacity_bytes": [(1.5, TypeError), ("lots", ValueError), (0, ValueError)],
    "model": [(3, TypeError)],
    "params": [("d_model=32", TypeError)],
    "implementation": [(3, TypeError)],
    "profiles_dir": [(3, TypeError)],
    "profile": [(42, TypeError)],
    "device": [(3.5, TypeError)],
    "ask": [("64", TypeError)],
    "world": [(2, TypeError)],
    "attr": [("", ValueError), (3, TypeError), ("2x", ValueError)],
    "request": [("8", TypeError), (8.5, TypeError), (True, TypeError), (0, ValueError), (-5, ValueError)],
    "batch_size_min": [(0, ValueError), ("1", TypeError)],
    "effective_batch_size": [(-1, ValueError), ("x", TypeError)],
    "limit": [("foo", ValueError)],
    "size_for": [("speed", ValueError)],
    "gradients": [("yes", TypeError)],
    "exact": [("no", TypeError)],
    "seq_len": [(0, ValueError), ("32", TypeError)],
    "batch_size": [(0, ValueError), ("8", TypeError)],
    "pool_data_bytes": [(-1, ValueError), (1.5, TypeError)],
    "process_bytes": [(-1, ValueError)], "free_bytes": [(-1, ValueError)], "total_bytes": [(-1, ValueError)],
    "free_source": [(3, TypeError)],
    "options": [({"foo": 1}, ValueError), ("stride=4", TypeError)],
    "settings": [({}, TypeError)], "trials": [({"max_trials": 2}, TypeError)],
    "seq_lens": [(3, TypeError)], "rank_devices": [(3, TypeError)],
    "plan": [(None, TypeError)], "ref": [("regressor", TypeError)],
    "path": [(3, TypeError)], "out": [(3, TypeError)], "run_dir": [(3, TypeError)],
    "on_trial": [(3, TypeError)], "on_notice": [(3, TypeError)], "on_step": [(3, TypeError)],
    "warn": [(3, TypeError)], "inform": [(3, TypeError)],
    "save": [("no", TypeError)], "progress": [("no", TypeError)], "unique_device": [("no", TypeError)],
    "aim": [("no", TypeError)], "strict": [("no", TypeError)], "suggest_budget": [("no", TypeError)],
    "evaluation": [("no", TypeError)],
    "host_malloc": [("no", TypeError)], "main_process": [("no", TypeError)], "boundary": [("no", TypeError)],
    "framework": [(3, TypeError)], "factory": [(3, TypeError), ("nope", ValueError)],
    "reserve_bytes": [("x", TypeError), (-1, ValueError)], "margin": [("x", TypeError), (1.5, ValueError)],
    "conservative_fraction": [(0, ValueError)],
    **{name: [("x", TypeError), (-1, ValueError)] for name in ("warmup_steps", "measured_steps", "val_steps",
                                                               "steady_steps", "plateau_steps", "max_trials")},
    "timeout_s": [(0, ValueError), ("x", TypeError)],
    "accelerator": [(None, TypeError)], "args": [("x", TypeError)], "run": [(None, TypeError)],
    "module": [(3, TypeError)],
    "steps": [(-1, ValueError), ("x", TypeError)],
}
# what each walk gives beyond BAD, where the parameter takes more there (a torch device, a profile's path)
MORE = {("FrameworkRun", "device"): [("bogus", ValueError), ("cuda:0", ValueError)],
        ("vramcal.batch_size", "profile"): [(None, TypeError)], ("vramcal.load_profile", "path"): [(None, TypeError)],
        ("vramcal.find_profile", "params"): [({"d_model": "x"}, TypeError)],
        ("vramcal.plan_calibration", "implementation"): [("bogus", ValueError)]}
NOT_WALKED = {"asked": "**asked: SizeRequest's fields, walked as SizeRequest's (and a name it has not refused: "
                       "test_an_unknown_asked_name_lists_the_known_ones)",
              "extra_preload": "worker_pool's preload, module names the worker server imports"}


class Reached(BaseException):
    """The walk reached work (a trial, a calibration): the door let the value through."""


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """(name, callable, the valid arguments around the bad one) for each public door."""
    import warnings

    from accelerate import Accelerator
    from test_lightning import profile_here
    from transformers import TrainingArguments

    from vramcal.integrations import accelerate, hf, lightning
    from vramcal.integrations.run import FrameworkRun
    from vramcal.sizing import answer

    tmp, profile, device = tmp_path_factory.mktemp("door"), profile_here(), host_device()
    path = save_profile(profile, tmp / "p.json")
    plan = vramcal.plan_calibration("user_models:mlp", PARAMS, device=host_device(budget(CAPACITY)),
                                    profiles_dir=tmp)
    arguments = TrainingArguments(output_dir=str(tmp / "out"), use_cpu=True, report_to=[])  # (resets accelerate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (profile_here's software is another's)
        run, started = FrameworkRun(profile), FrameworkRun(profile, inform=lambda line: None)
        started.start()
        accelerator = Accelerator(cpu=True)
    return [
        ("vramcal.select_devices", vramcal.select_devices, {"gpu": "none"}),
        ("vramcal.calibrate", vramcal.calibrate, {"gpu": "none", "capacity_bytes": "1GiB", "profiles_dir": tmp,
                                                  "progress": False}),
        ("vramcal.plan_calibration", vramcal.plan_calibration, {"device": device, "profiles_dir": tmp}),
        ("vramcal.run_calibration", vramcal.run_calibration, {"plan": plan, "save": False}),
        ("vramcal.find_profile", vramcal.find_profile, {"gpu": "none", "path": path}),
        ("vramcal.size_for", vramcal.size_for, {"gpu": "none", "capacity_bytes": "1GiB", "profiles_dir": tmp,
                                                "progress": False}),
        ("vramcal.locate_profile", vramcal.locate_profile, {"device": device, "profile": profile}),
        ("vramcal.model_ref", vramcal.model_ref, {"model": "regressor", "device": device}),
        ("vramcal.probe_command", vramcal.probe_command, {"device": device, "ref": profile.model}),
        ("vramcal.batch_size", vramcal.batch_size, {"profile": profile}),
        ("vramcal.size", vramcal.size, {"profile": profile}),
        ("vramcal.api.answer", answer, {"profile": profile, "seq_len": profile.model.params["seq_len"]}),
        ("vramcal.api.verify", vramcal.api.verify, {"profile": profile, "batch_size": 1}),
        ("vramcal.SizeRequest", vramcal.SizeRequest, {}),
        ("vramcal.load_profile", vramcal.load_profile, {"path": path}),
        ("vramcal.LimitSettings", vramcal.LimitSettings, {}),
        ("vramcal.TrialSettings", vramcal.TrialSettings, {}),
        ("vramcal.ModelRef.make", vramcal.ModelRef.make, {"factory": "user_models:mlp"}),
        ("FrameworkRun", FrameworkRun, {"profile": profile}),
        ("FrameworkRun.resize", run.resize, {"batch_size": 1}),
        ("FrameworkRun.finish", started.finish, {}),
        ("FrameworkRun.conclude", started.conclude, {}),
        ("VramcalBatchSize", lightning.VramcalBatchSize, {"profile": profile}),
        ("VramcalCallback", hf.VramcalCallback, {"profile": profile}),
        ("VramcalCallback.sized", hf.VramcalCallback(profile).sized, {"args": arguments}),
        ("accelerate.sized", accelerate.sized, {"accelerator": accelerator, "profile": profile}),
        ("accelerate.measured", accelerate.measured, {"run": run, "accelerator": accelerator}),
    ]


def test_every_public_door_refuses_each_bad_value_in_one_line_naming_its_parameter(doors, monkeypatch):
    import inspect
    import warnings

    import vramcal.service.calibrate
    import vramcal.service.pool

    def reached(*args, **kwargs):
        raise Reached()

    monkeypatch.setattr(vramcal.service.calibrate, "run_trials", reached)  # a value let through would start trials
    monkeypatch.setattr(vramcal.service.calibrate, "TrialRunner", reached)
    monkeypatch.setattr(vramcal.service.pool, "TrialRunner", reached)
    walked, let_through, unnamed = 0, [], []
    for name, door, valid in doors:
        for parameter in inspect.signature(door).parameters.values():
            if parameter.name in NOT_WALKED or parameter.kind is parameter.VAR_KEYWORD:
                continue
            assert parameter.name in BAD, f"{name}: no bad values for {parameter.name}= (add them, or say why not)"
            for bad, error in BAD[parameter.name] + MORE.get((name, parameter.name), []):
                walked += 1
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        door(**{**valid, parameter.name: bad})
                except Reached:
                    let_through.append(f"{name}({parameter.name}={bad!r}): reached the trials")
                    continue
                except Exception as raised:  # noqa: BLE001 - the walk sorts what each door raised
                    text = str(raised)
                    if not isinstance(raised, error):
                        let_through.append(f"{name}({parameter.name}={bad!r}): {type(raised).__name__}: {text}")
                    elif "\n" in text or re.search(r"(^|\s|`)--[a-z]", text) or not re.search(
                            rf"\b{parameter.name}\b|\bd_model\b", text):
                        unnamed.append(f"{name}({parameter.name}={bad!r}): {text}")
                    continue
                let_through.append(f"{name}({parameter.name}={bad!r}): accepted")
    assert walked > 150
    assert let_through == [], "\n".join(let_through)
    assert unnamed == [], "\n".join(unnamed)


def test_an_unknown_asked_name_lists_the_known_ones():
    from test_lightning import profile_here

    from vramcal.integrations.hf import VramcalCallback
    from vramcal.integrations.lightning import VramcalBatchSize

    for door in (VramcalCallback, VramcalBatchSize):
        with pytest.raises(TypeError, match=rf"^{door.__name__}\(\) has no argument batchsize=: .* it takes what a "
                                            r"run asks: limit, batch_size_min, request"):
            door(profile_here(), batchsize=64)
