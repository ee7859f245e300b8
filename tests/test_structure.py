"""The house (issues 12 and 24): layers that import only downwards and no cycle, a pure calibration core, the
model families told apart in one place, the trial settings' defaults written once, short functions and
commands, commands registered in one place, docstring references that resolve, and a light ``import vramcal``.

The layers, from the ground up (DESIGN.md, "The parts"): each module imports only modules of its own layer
or below.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vramcal"
# The layers, lowest first: a module's prefix decides its layer (the longest prefix that matches).
LAYERS = (
    ("vramcal", "vramcal.units", "vramcal.files", "vramcal.records", "vramcal.oom", "vramcal.environment",
     "vramcal.schema", "vramcal.words"),  # records and their checked reading
    ("vramcal.workload", "vramcal.calibration"),  # what a trial runs; the pure calibration core
    ("vramcal.models", "vramcal.measure", "vramcal.estimate"),  # the families; processes and hardware; fake tensors
    ("vramcal.profile",),  # the profile file
    # the sizing wing (a profile -> a batch size: lookup, staleness, batching, the sampler, variants, sharding), run
    # time; cards not in hand
    ("vramcal.sizing", "vramcal.forecast", "vramcal.estimate.learned"),
    # the service under the facade (devices, the worker pool, the calibration loop and its journal, size_for);
    # reports from profiles, and progress for people
    ("vramcal.service", "vramcal.report"),
    ("vramcal.train",),  # the bundled trainer, and what the worker fork server imports (train.preload)
    ("vramcal.tune", "vramcal.integrations"),  # studies, frameworks
    ("vramcal.cli", "vramcal.api", "vramcal.__main__"),  # the commands; the public facade, which nothing imports
)
# tested with recorded or synthetic trials: no process, hardware or trainer code
PURE = ("vramcal.calibration", "vramcal.records", "vramcal.schema", "vramcal.units", "vramcal.profile",
        "vramcal.sizing", "vramcal.forecast", "vramcal.report", "vramcal.words")
PROCESS = ("vramcal.measure", "vramcal.train", "vramcal.api", "vramcal.service", "vramcal.tune", "vramcal.cli")


def import_graph() -> dict[str, set[str]]:
    """Module -> the vramcal modules it imports anywhere (top level or inside functions)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:  # a submodule named, else the package's names
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("vramcal") else None
                if found and found != name:  # a submodule's import of its own package's __init__ counts too
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the graph was really read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix of ``module``."""
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and DESIGN.md)"
    return max(matches)[1]


def test_every_import_runs_down_the_layers():
    graph = import_graph()
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a)]
    assert upward == []


def test_nothing_inside_vramcal_imports_its_facade():
    """vramcal.api is the users' door (issue 58): the commands, the trainer and the integrations call the service."""
    assert sorted(a for a, targets in import_graph().items() if "vramcal.api" in targets) == []


def test_the_layer_check_finds_an_upward_import():
    assert layer("vramcal.calibration.search") < layer("vramcal.profile") < layer("vramcal.service.calibrator")
    assert layer("vramcal.measure.worker") == layer("vramcal.models.registry") < layer("vramcal.train.loop")


def reaches(graph: dict[str, set[str]], module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for other in graph[todo.pop()] - seen:
            seen.add(other)
            todo.append(other)
    return seen


def test_records_and_pure_parts_import_no_process_or_hardware_code():
    graph = import_graph()
    pure = [m for m in graph if m.startswith(PURE)]
    assert "vramcal.calibration.search" in pure and "vramcal.report.markdown" in pure
    for module in pure:
        assert not {m for m in reaches(graph, module) if m.startswith(PROCESS)}, module


def test_no_module_but_the_registry_tells_the_model_families_apart_by_name():
    """Comparisons with a family's name, or with the factory paths profiles record, live in the registry (and a
    family's own module, checking that a reference is its own)."""
    names = {"regressor", "lm", "vramcal.models.regressor:training_step", "vramcal.models.lm:training_step"}
    allowed = {"vramcal/models/registry.py", "vramcal/models/regressor/spec.py", "vramcal/models/lm.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            constants = []
            if isinstance(node, ast.Compare):
                constants = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
            elif isinstance(node, ast.Attribute) and node.attr == "family":
                if getattr(node.value, "id", "") != "registry":  # registry.family(name) is the registry's answer
                    found.append(f"{where}:{node.lineno} .family")
            if any(c.value in names for c in constants) and where not in allowed:
                found.append(f"{where}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in names - {"regressor", "lm"} and where not in allowed:
                found.append(f"{where}:{node.lineno} names a factory path")
    assert found == []


def test_the_language_model_is_named_only_in_models():
    """What differs between the families is the family's (issue 58): outside vramcal/models/ a trait is asked for
    (``Family.documents``), never the language model by name."""
    named = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "vramcal").rglob("*.py"))
             if "models" not in p.relative_to(ROOT / "vramcal").parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if "language_model" in line]
    assert named == []


def test_the_trial_settings_defaults_are_written_once():
    """Each default of :class:`vramcal.records.TrialSettings` is a literal there only: elsewhere a parameter or
    a field of that name takes its default from the record."""
    from vramcal.records import TrialSettings

    names = {f.name for f in dataclasses.fields(TrialSettings)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.args + node.args.kwonlyargs
                defaults = [*([None] * (len(node.args.args) - len(node.args.defaults))), *node.args.defaults,
                            *node.args.kw_defaults]
                found += [f"{path.name}:{node.lineno} {a.arg}" for a, d in zip(arguments, defaults)
                          if a.arg in names and isinstance(d, ast.Constant) and d.value is not None]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.target.id in names and isinstance(node.value, ast.Constant) and node.value.value is not None:
                    found.append(f"{path.name}:{node.lineno} {node.target.id}")
    assert found == []  # (the trainer's LR warm-up, TrainConfig.warmup_steps, defaults to None: 5 % of the run)
    from vramcal.cli.probe import probe

    defaults = {p.name: p.default for p in probe.params if p.name in names}
    assert defaults == {k: v for k, v in dataclasses.asdict(TrialSettings()).items()}


def test_no_function_in_the_package_is_over_50_lines():
    """From its ``def`` to its last line, docstring included (a command's option decorators are declarations)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert long == []


# ------------------------------------------------------------------------------ docstring references

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([\w.]+)`")
DOTTED = re.compile(r"(?<![\w./`-])(vramcal(?:\.\w+)+)")


def docstring_references() -> list[tuple[str, list[str], str]]:
    """(module, enclosing classes, name) for each Sphinx role and each ``vramcal.`` dotted name in a docstring."""
    found = []

    def visit(module: str, node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False) or ""
            found.extend((module, scope, name.rstrip(".")) for name in {*ROLE.findall(text), *DOTTED.findall(text)})
        for child in ast.iter_child_nodes(node):
            visit(module, child, scope + [child.name] if isinstance(child, ast.ClassDef) else scope)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"),
              ast.parse(path.read_text()), [])
    return found


def resolves(module: str, scope: list[str], name: str) -> bool | None:
    """Whether ``name`` names something: a ``vramcal.`` path, or a name in the module (or its enclosing class,
    or Python's builtins). None for another package's name, which is not checked."""
    def walk(target: object, parts: list[str]) -> bool:
        for part in parts:
            annotations = getattr(target, "__annotations__", {}) if isinstance(target, type) else {}
            if not hasattr(target, part) and part not in annotations:
                return False
            target = getattr(target, part, None)
        return True

    parts = name.split(".")
    if parts[0] == "vramcal":
        for split in range(len(parts), 0, -1):
            try:
                return walk(importlib.import_module(".".join(parts[:split])), parts[split:])
            except ModuleNotFoundError:
                continue
    home = importlib.import_module(module)
    places = [builtins, home]
    for name_ in scope:  # a class defined inside a function is not an attribute of the module: its own names stay
        places.append(getattr(places[-1], name_, None))
    places = [place for place in places if place is not None]
    if any(walk(place, parts) for place in places):
        return True
    return None if "." in name else False


def test_every_docstring_reference_resolves():
    references = docstring_references()
    assert len(references) > 200  # the docstrings were really read
    unresolved = sorted({f"{m}: {n}" for m, s, n in references if resolves(m, s, n) is False})
    assert unresolved == []


def test_the_reference_check_finds_a_stale_reference():
    assert resolves("vramcal.api", [], "vramcal.train.sizing.choose_batch_size") is False
    assert resolves("vramcal.api", [], "no_such_name") is False
    assert resolves("vramcal.calibration.fit2d", ["SeqLens"], "design") is True
    assert resolves("vramcal.measure.trial", [], "vramcal.measure.trial.TrialRunner.context") is True


def test_every_command_is_registered_in_one_place_and_is_short():
    from vramcal.cli import main

    registered = {name for name, command in main.commands.items()}
    assert registered == {"probe", "size", "show", "report", "limits", "estimate", "cost", "train", "data", "tune"}
    sources = "\n".join(p.read_text() for p in (PACKAGE / "cli").glob("*.py") if p.name != "__init__.py")
    assert "add_command" not in sources and "main.command" not in sources  # no self-registration

    def callbacks(group: click.Group):
        for command in group.commands.values():
            if isinstance(command, click.Group):
                yield from callbacks(command)
            elif command.callback is not None:
                yield command.callback

    for callback in callbacks(main):
        function = ast.parse(textwrap.dedent(inspect.getsource(callback))).body[0]
        body = function.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        span = body[-1].end_lineno - body[0].lineno + 1
        assert span <= 32, f"{callback.__name__}: {span} lines"


def test_importing_vramcal_loads_no_torch():
    code = ("import sys, vramcal, vramcal.cli, vramcal.api; "
            "print(sorted(m for m in ('torch', 'triton', 'mamba_ssm', 'pynvml', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


HEAVY = ("torch", "numpy", "pandas", "matplotlib", "transformers", "optuna", "lightning")


def function_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, the module imported, the line's text) of each import of a vramcal module made inside a
    function (not an ``if TYPE_CHECKING:`` block)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vramcal"):
                    module = next((f"{node.module}.{a.name}" for a in node.names
                                   if _is_module(f"{node.module}.{a.name}")), node.module)
                elif isinstance(node, ast.Import) and node.names[0].name.startswith("vramcal"):
                    module = node.names[0].name
                else:
                    continue
                text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                found.append((str(path.relative_to(ROOT)), node.lineno, module, text))
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_imports_inside_functions_defer_something_heavy_and_say_what():
    """An import is made inside a function only where it defers a heavy library (the commands start without
    numpy or torch), and says so; importing a light module there saves nothing and hides the dependency."""
    found = function_imports()
    assert len(found) > 10  # the imports were really read
    unsaid = [f"{file}:{line}" for file, line, _, text in found if "# loads " not in text]
    assert unsaid == []
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    light = {}
    for module in sorted({module for _, _, module, _ in found}):
        loaded = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.strip()
        if not loaded:
            light[module] = [f"{file}:{line}" for file, line, m, _ in found if m == module]
    assert light == {}, "these load nothing heavy: import them at the top of the module"
