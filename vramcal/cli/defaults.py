"""The options' defaults from TOML files (the user's ``config.toml``, the project's ``vramcal.toml``, or the one file
``VRAMCAL_CONFIG`` names), handed to click as the root group's ``default_map``; every value checked as the option's
own type checks it when the file is read. The files, their order and layout: DESIGN.md "Defaults: ``vramcal.toml``".
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import click
from click.core import UNSET

from vramcal.cli.options import single_line
from vramcal.schema import SchemaError, read_value
from vramcal.schema import shown as schema_shown

ENV = "VRAMCAL_CONFIG"
PROJECT_FILE = "vramcal.toml"
META = "vramcal.defaults"  # the key of the root's Defaults in click's ``Context.meta``
Words = tuple[str, ...]  # a command below ``vramcal``: ("probe",), ("data", "es-sample"); () the top level


class DefaultsError(click.ClickException):
    """A defaults file vramcal cannot use: one line naming the file, the key and the value; exit 2, as a bad
    option value."""

    exit_code = click.UsageError.exit_code


@dataclasses.dataclass(frozen=True)
class Setting:
    """One option's default as a file gives it: the command, the parameter name, the value as written, the file and
    its table (``()``: the top level)."""

    command: Words
    name: str
    value: Any
    source: Path
    table: Words

    @property
    def where(self) -> str:
        """The file, and its table unless the top level: ``/p/vramcal.toml [probe]``."""
        return f"{self.source} [{'.'.join(self.table)}]" if self.table else str(self.source)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The defaults files read (lowest priority first) and, per command and option, the setting that won."""

    files: tuple[Path, ...]
    settings: tuple[Setting, ...]

    def default_map(self) -> dict[str, Any]:
        """click's nested ``default_map`` for the root group: ``{"probe": {"profiles_dir": "p"}, "data":
        {"es-sample": {"bar": "5s"}}}``."""
        tree: dict[str, Any] = {}
        for setting in self.settings:
            node = tree
            for word in setting.command:
                node = node.setdefault(word, {})
            node[setting.name] = setting.value
        return tree


@dataclasses.dataclass(frozen=True)
class InForce:
    """What one command takes for an option a file sets somewhere: the file's value, or the option's default."""

    command: Words
    name: str
    value: Any
    source: str  # Setting.where, or "default"


def apply_defaults(ctx: click.Context) -> Defaults:
    """Read the defaults files and give them to click as ``ctx.default_map`` (the root group's context, before its
    subcommand parses); kept in ``ctx.meta[META]`` for ``vramcal show --config``.

    Raises:
        DefaultsError: a file that cannot be used (:func:`config_files`, :func:`resolve`).
    """
    found = resolve(ctx.command, config_files(Path.cwd(), os.environ))
    ctx.default_map = found.default_map()
    ctx.meta[META] = found
    return found


def config_files(cwd: Path, environ: Mapping[str, str]) -> tuple[Path, ...]:
    """The defaults files in force, lowest priority first: ``VRAMCAL_CONFIG``'s alone, else the user's and the
    project's that exist.

    Raises:
        DefaultsError: ``VRAMCAL_CONFIG`` names no file: fix the path or unset it.
    """
    named = environ.get(ENV)
    if named:
        path = cwd / Path(named).expanduser()
        if not path.is_file():
            raise DefaultsError(f"{ENV}={named} names no file: fix the path, or unset {ENV} to read "
                                f"{user_file(environ)} and {PROJECT_FILE}")
        return (path,)
    return tuple(path for path in (user_file(environ), project_file(cwd)) if path is not None and path.is_file())


def user_file(environ: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/vramcal/config.toml``; ``~/.config`` when the variable is unset, empty or relative (the
    XDG Base Directory specification ignores a relative one)."""
    base = environ.get("XDG_CONFIG_HOME", "")
    home = Path(environ.get("HOME") or Path.home())
    return (Path(base) if os.path.isabs(base) else home / ".config") / "vramcal" / "config.toml"


def project_file(cwd: Path) -> Path | None:
    """The first ``vramcal.toml`` in ``cwd`` or a parent, stopping at a folder holding ``.git``; None if none."""
    for folder in (cwd, *cwd.parents):
        if (folder / PROJECT_FILE).is_file():
            return folder / PROJECT_FILE
        if (folder / ".git").exists():
            return None
    return None


def resolve(root: click.Group, files: tuple[Path, ...]) -> Defaults:
    """The settings ``files`` give ``root``'s commands, every value checked; a later file wins.

    Raises:
        DefaultsError: a file that cannot be read or is not TOML, a table that names no command, a key that is not
            an option of any command it applies to, a key set twice in one table, or a value the option refuses.
    """
    winners: dict[tuple[Words, str], Setting] = {}
    for path in files:
        winners.update(_table(path, read_toml(path), (), root))
    return Defaults(files, tuple(winners.values()))


def read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML document (the standard library's :mod:`tomllib`), a UTF-8 byte-order mark before it left out
    (TOML is UTF-8, and editors on Windows start a file with one).

    Raises:
        DefaultsError: the file cannot be read, or is not TOML (naming the line that is not).
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Notepad's, PowerShell's) is no TOML
    except OSError as error:
        raise DefaultsError(f"{path}: cannot read it ({error.strerror}): check its permissions") from None
    except UnicodeDecodeError:
        raise DefaultsError(f"{path}: not UTF-8 text, so not TOML: save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        number = re.search(r"line (\d+)", str(error))
        lines = text.splitlines()
        line = lines[int(number[1]) - 1].strip() if number and int(number[1]) <= len(lines) else ""
        raise DefaultsError(f"{path}: not valid TOML ({error})" + (f": {line}" if line else "")
                            + '; write key = value with text in quotes, e.g. capacity = "12GiB"') from None


def in_force(root: click.Group, found: Defaults) -> list[InForce]:
    """For each option a file sets, what every command with that option takes, and from where."""
    named = {setting.name for setting in found.settings}
    won = {(setting.command, setting.name): setting for setting in found.settings}
    rows = []
    for words, command in _commands(root, ()):
        for param in command.params:
            if not isinstance(param, click.Option) or param.name not in named:
                continue
            setting = won.get((words, param.name))
            if setting is not None:
                rows.append(InForce(words, param.name, setting.value, setting.where))
                continue
            default = param.get_default(click.Context(command, info_name=words[-1]))
            rows.append(InForce(words, param.name, None if default is UNSET else default, "default"))
    return sorted(rows, key=lambda row: (row.name, row.command))


def shown(value: Any) -> str:
    """A value as TOML writes it (``"12GiB"``, ``0.1``, ``true``, ``["a", "b"]``), on one line."""
    if isinstance(value, tuple):
        value = list(value)
    return "(none)" if value is None else json.dumps(value, default=str, ensure_ascii=False)


def _table(path: Path, table: dict[str, Any], where: Words, command: click.Command) -> dict[tuple[Words, str], Setting]:
    """The settings of ``table``, the table of ``command`` at ``where``: its keys for every command at or below it
    that has the option, then its own tables' settings over them."""
    subcommands = command.commands if isinstance(command, click.Group) else {}
    below = list(_commands(command, where))
    found: dict[tuple[Words, str], Setting] = {}
    spelled: dict[tuple[Words, str], str] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key not in subcommands:
                known = (f"the commands are {', '.join(sorted(subcommands))}" if subcommands else
                         f"vramcal {' '.join(where)} has no subcommands")
                raise DefaultsError(f"{path}: [{'.'.join((*where, key))}] names no vramcal command ({known}): rename "
                                    f"the table or remove it")
            continue
        applies = [(words, sub, param) for words, sub in below if (param := _option(sub, key)) is not None]
        if not applies:
            raise DefaultsError(_unknown(path, where, key, value, command, below))
        for words, sub, param in applies:
            if (words, param.name) in spelled:
                raise DefaultsError(f"{_at(path, where, key, value)}: {spelled[words, param.name]} in the same table "
                                    f"sets the same option: keep one of them")
            _check(path, where, key, value, words, sub, param)
            spelled[words, param.name] = key
            found[words, param.name] = Setting(words, param.name, value, path, where)
    for key, value in table.items():
        if isinstance(value, dict):
            found.update(_table(path, value, (*where, key), subcommands[key]))
    return found


def _commands(command: click.Command, words: Words) -> Iterator[tuple[Words, click.Command]]:
    """``command`` (unless the root: its own options are parsed before the files are read) and those below it."""
    if words:
        yield words, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from _commands(sub, (*words, name))


def _option(command: click.Command, key: str) -> click.Option | None:
    """``command``'s option that ``key`` names: its parameter name, or a long flag without its dashes."""
    for param in command.params:
        names = {param.name, *(flag[2:].replace("-", "_") for flag in param.opts if flag.startswith("--"))}
        if isinstance(param, click.Option) and key.replace("-", "_") in names:
            return param
    return None


def _check(path: Path, where: Words, key: str, value: Any, words: Words, command: click.Command,
           param: click.Option) -> None:
    """``value`` through the option's click type and callback, as click takes a ``default_map`` value.

    Raises:
        DefaultsError: the option refuses it.
    """
    flag = max(param.opts, key=len)
    how = f"write a value `vramcal {' '.join(words)} {flag}` takes, or remove the key"
    many = param.multiple or param.nargs != 1
    listed = isinstance(value, list)
    split = isinstance(value, str) and param.nargs != 1
    if (listed != many and not split) or not all(isinstance(item, str | int | float)
                                                 for item in (value if listed else [value])):
        kind = 'a list, e.g. ["a", "b"]' if many else "one text, number or true/false"
        raise DefaultsError(f"{_at(path, where, key, value)}: {flag} takes {kind}: {how}")
    for index, item in enumerate(value if listed else [] if split else [value]):
        try:
            read_value(item, file_type(param, index), key)
        except SchemaError as error:  # "key = value is a string, not a whole number": the file's words for value
            why = str(error).removeprefix(f"{key} = {schema_shown(item)} ")
            item_of = f": item {index + 1} " if listed else " "
            raise DefaultsError(f"{_at(path, where, key, value)}{item_of}{why}: {how}") from None
    taken = param.type.split_envvar_value(value) if split else value  # as click splits a default_map string
    try:
        param.process_value(click.Context(command, info_name=words[-1]), taken)
    except (click.BadParameter, TypeError, ValueError) as error:  # a type's own error, for a value of a TOML type
        why = error.message if isinstance(error, click.BadParameter) else str(error)
        raise DefaultsError(f"{_at(path, where, key, value)}: {flag} refuses it ({single_line(why)}): {how}") from None


def file_type(param: click.Parameter, index: int = 0) -> Any:
    """The TOML type a file's value of ``param`` must have (for a list, its ``index``-th item's), read by
    :func:`vramcal.schema.read_value` before the option's own type converts it: true/false for a flag, a whole
    number for an integer option, a number for a float one, text for a choice or a path; a vramcal option type
    says its own (``file_type``: text, or text or a whole number, as ``capacity`` and ``gpu`` take), and any other
    text or a whole number, as click turns either into the flag's text. A value of another type is refused
    here, in one line, where it once reached a parser of text (``[estimate] gpus = 5``: an AttributeError) or
    was cut to fit (``epochs = 2.5`` trained 2)."""
    kind = param.type.types[index] if isinstance(param.type, click.Tuple) else param.type
    if getattr(param, "is_flag", False) or isinstance(kind, click.types.BoolParamType):
        return bool
    for click_type, hint in ((click.types.IntParamType, int), (click.types.FloatParamType, float),
                             (click.Choice, str), (click.Path, str)):
        if isinstance(kind, click_type):
            return hint
    return getattr(kind, "file_type", str | int)


def _unknown(path: Path, where: Words, key: str, value: Any, command: click.Command,
             below: list[tuple[Words, click.Command]]) -> str:
    at = _at(path, where, key, value)
    if not where and _option(command, key) is not None:
        return f"{at}: an option of vramcal itself, parsed before the files are read: give it on the command line"
    options = sorted({name for _, sub in below for param in sub.params if isinstance(param, click.Option)
                      for name in (param.name, *(flag[2:] for flag in param.opts if flag.startswith("--")))})
    close = difflib.get_close_matches(key, options, n=1)
    scope = f"vramcal {' '.join(where)} has no option {key}" if where else f"no vramcal command has an option {key}"
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{at}: {scope}: {hint}rename or remove the key (`vramcal {' '.join(where) or 'COMMAND'} --help` lists "
            f"the options)")


def _at(path: Path, where: Words, key: str, value: Any) -> str:
    return f"{path}: " + (f"[{'.'.join(where)}] " if where else "") + f"{key} = {shown(value)}"
