"""The option names an installed engine's launch parser accepts, read from its source without importing it.

Building vLLM's or SGLang's own parser imports torch and the engine (15 s and more on a small CPU box); the
launchers' pre-flight must answer a typo in under a second. So the engine's argument files are read with
:mod:`ast`: every flag-shaped string literal (``"--port"``, ``"-tp"``, ``Arg(aliases=["--model"])``) and every
annotated class field (``max_model_len: int`` -> ``--max-model-len``; both engines derive flags from dataclass
fields). The set is deliberately a superset: a name it holds may still be refused by the engine, never the
reverse. ``tests/*/test_engine_flags*`` build each release's real parser and assert that every option it accepts is
here, and that every option taking no value is among :attr:`EngineFlags.switches`.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EngineFlags", "scan_engine_flags", "unknown_flag", "model_given"]

_FLAG = re.compile(r"^--?[A-Za-z][\w.-]*$")
# the argparse actions that take a value; any other (store_true, BooleanOptionalAction, an engine's own Action
# class) counts as a switch: too many switches only make a bare word count as the model, never a refusal
_VALUE_ACTIONS = ("store", "append", "extend")
_FEW = 50  # fewer flags than this: the source layout is not one this scanner knows; check nothing


@dataclass(frozen=True)
class EngineFlags:
    """Every option an engine's launch parser may accept (:attr:`flags`) and those that take no value
    (:attr:`switches`, a superset too: a bare word after one of them is a positional argument)."""

    flags: frozenset[str]
    switches: frozenset[str]

    def knows(self, option: str, underscores: bool) -> bool:
        """``option`` (``--name`` or ``--name=value``) may be one of the engine's: listed, the negation of a listed
        switch (``--no-X``; vLLM 0.33's ``--disable-X`` for ``--enable-X`` and back), a dotted sub-key (vLLM's
        ``--compilation-config.level``) or an unambiguous-looking prefix (argparse abbreviations)."""
        name = option.split("=", 1)[0]
        if underscores:
            name = name[:2] + name[2:].replace("_", "-")
        base = name.split(".", 1)[0]
        if {name, *_forms(base)} & self.flags:
            return True
        return len(base) > 3 and any(f.startswith(base) for f in self.flags)

    def takes_value(self, option: str) -> bool:
        """``option`` (as written, without ``=``) may take the next word as its value."""
        return not set(_forms(option)) & self.switches and not option.startswith("--no-")


def _forms(flag: str) -> tuple[str, ...]:
    """``flag`` and the flags it may negate: ``--no-X`` -> ``--X``; ``--disable-X`` <-> ``--enable-X``."""
    forms = [flag, "--" + flag[5:]] if flag.startswith("--no-") else [flag]
    for a, b in (("--disable-", "--enable-"), ("--enable-", "--disable-")):
        forms += [b + f[len(a) :] for f in forms if f.startswith(a)]
    return tuple(forms)


def _flag_literals(tree: ast.AST) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _FLAG.match(node.value):
            yield node.value


def _fields(tree: ast.AST) -> Iterable[tuple[list[str], bool]]:
    """``([--field-name, flags named in its annotation], is_bool)`` for every annotated name in a class body (SGLang
    names a field's aliases in it: ``A[bool, Arg(aliases=["--enable-hicache"])]``)."""
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names = ["--" + stmt.target.id.replace("_", "-").strip("-"), *_flag_literals(stmt.annotation)]
                yield names, re.search(r"\bbool\b", ast.unparse(stmt.annotation)) is not None


def _add_argument_calls(tree: ast.AST) -> Iterable[tuple[list[str], bool]]:
    """``(its flag literals, may take no value)`` for every ``add_argument`` call."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        action = next((k.value for k in node.keywords if k.arg == "action"), None)
        takes_value = action is None or (isinstance(action, ast.Constant) and action.value in _VALUE_ACTIONS)
        yield names, not takes_value


def scan_files(paths: Iterable[Path]) -> EngineFlags:
    """The flags the Python files ``paths`` can give a parser (unreadable or unparsable files are passed over)."""
    flags: set[str] = {"-h", "--help"}
    switches: set[str] = {"-h", "--help"}
    calls: list[list[str]] = []
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        flags.update(_flag_literals(tree))
        for names, is_bool in _fields(tree):
            flags.update(names)
            if is_bool:
                switches.update(names)
        for names, switch in _add_argument_calls(tree):
            if switch:
                switches.update(names)
            else:
                calls.append(names)
    for names in calls:  # an alias of a bool field's flag (vLLM's "--enable-expert-parallel", "-ep") is a switch too
        if switches.intersection(names):
            switches.update(names)
    return EngineFlags(frozenset(flags), frozenset(switches))


def scan_engine_flags(package: str, sources: Sequence[str]) -> EngineFlags | None:
    """The flags of the installed ``package`` from its files matching the globs ``sources`` (relative to the package
    folder), found without importing it; None when it is not installed or the files do not look like a parser's."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    found = scan_files(sorted({p for pattern in sources for p in root.glob(pattern)}))
    return found if len(found.flags) >= _FEW else None


def unknown_flag(argv: Sequence[str], known: EngineFlags, underscores: bool) -> tuple[str, list[str]] | None:
    """The first option in ``argv`` the engine does not have and the closest names it has, or None."""
    for a in argv:
        if a == "--":
            break
        if not _FLAG.match(a.split("=", 1)[0]) or known.knows(a, underscores):
            continue
        name = a.split("=", 1)[0]
        return name, difflib.get_close_matches(name, sorted(known.flags), n=2, cutoff=0.75)
    return None


def model_given(argv: Sequence[str], model_flags: Sequence[str], positional: bool, known: EngineFlags | None) -> bool:
    """``argv`` names a model: one of ``model_flags``, or (where the engine takes it bare) a word that is not the
    value of the option before it. Unknown options count as switches, so a doubt is never a refusal."""
    if any(a.split("=", 1)[0] in model_flags for a in argv):
        return True
    if not positional:
        return False
    prev: str | None = None
    for a in argv:
        if a == "--":
            return True
        if not a.startswith("-") or not _FLAG.match(a.split("=", 1)[0]):
            value_of_prev = (
                prev is not None
                and "=" not in prev
                and known is not None
                and known.takes_value(prev)
                and prev in known.flags
            )
            if not value_of_prev:
                return True
        prev = a
    return False
