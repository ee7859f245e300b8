"""The house (issue 12): no import cycles, short command functions, commands registered in one place, and a
light ``import vramcal``."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vramcal"


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
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for target in targets:
                found = resolve(target) if target.startswith("vramcal") else None
                if found and found != name and not name.startswith(found + "."):  # a package's own __init__
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


def test_records_and_pure_parts_import_no_process_or_hardware_code():
    graph = import_graph()

    def reaches(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for other in graph[todo.pop()] - seen:
                seen.add(other)
                todo.append(other)
        return seen

    for pure in ("vramcal.records", "vramcal.profile", "vramcal.calibration.search", "vramcal.calibration.fit",
                 "vramcal.calibration.surface", "vramcal.sizing", "vramcal.report.markdown"):
        assert not {m for m in reaches(pure) if m.startswith(("vramcal.measure", "vramcal.train.loop"))}, pure


def test_every_command_is_registered_in_one_place_and_is_short():
    from vramcal.cli import main

    registered = {name for name, command in main.commands.items()}
    assert registered == {"probe", "show", "report", "limits", "train", "data", "tune"}
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
