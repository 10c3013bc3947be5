"""The options and help both launchers share (``rr-server launch vllm|sglang``): rr's ``--routed-experts-format``,
``--help`` that prints rr's options before the engine's own, and taking rr's flag out before the engine parses."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rr_client.core.codec import FORMATS
from rr_client.core.engines import ENGINES
from rr_client.core.engines import engine as find_engine

__all__ = [
    "FORMAT_FLAG",
    "launcher_parser",
    "add_shared_options",
    "wants_help",
    "engine_help",
    "take_format_flag",
    "preflight",
]

# rr's own flag (not the engine's): the default routed_experts_format of /generate and the OpenAI endpoints
FORMAT_FLAG = "--routed-experts-format"


def launcher_parser(
    engine: str, passes_to: str, description: str
) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    """``rr-server launch <engine>``'s parser (rr's options only; the engine's own arguments pass through) and the
    group rr's options go in; the caller adds its own, then :func:`add_shared_options`."""
    p = argparse.ArgumentParser(
        prog=f"rr-server launch {engine.lower()}",
        add_help=False,
        usage=f"rr-server launch {engine.lower()} [rr options] <{passes_to} arguments...>",
        description=description,
    )
    return p, p.add_argument_group(f"rr's options (every other argument goes to {engine} untouched)")


def add_shared_options(group: argparse._ArgumentGroup, engine: str) -> None:
    """The options both launchers take (listed last in their help): ``--routed-experts-format`` and ``--help``."""
    group.add_argument(
        FORMAT_FLAG,
        choices=FORMATS,
        help="the server's default routed_experts_format: npy (rr's compact .npy, the default), sglang "
        "(SGLang's own int32 base64) or ref (a RoutingRef; the rows stay in the server's routing "
        "store); a request's own field wins",
    )
    group.add_argument("-h", "--help", action="store_true", help=f"rr's options, then {engine}'s own help")


def wants_help(argv: Sequence[str]) -> bool:
    """``-h`` / ``--help`` (or vLLM's ``--help=GROUP``) among the arguments."""
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in argv)


def engine_help(parser: argparse.ArgumentParser, engine: str, dist: str, show: Callable[[], object]) -> int:
    """rr's options first, then the engine's own help by ``show()`` (its exit code); a line if it is missing."""
    sys.stdout.write(parser.format_help() + f"\n{engine}'s own arguments:\n")
    sys.stdout.flush()
    if importlib.util.find_spec(dist) is None:
        print(f"  {engine}'s help is unavailable: {dist} is not installed (pip install 'rr-replay[{dist}]')")
        return 0
    try:
        rc = show()
        return rc if isinstance(rc, int) else 0
    except SystemExit as e:  # argparse's --help ends with sys.exit(0)
        return e.code if isinstance(e.code, int) else 0
    except ImportError as e:
        print(f"  {engine}'s help is unavailable: importing {dist} failed: {type(e).__name__}: {e}")
        return 1


def take_format_flag(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """Remove ``--routed-experts-format {npy,sglang,ref}`` (SGLang's parser would refuse it); ConfigurationError (a
    ValueError) on a missing or bad value."""
    from rr_client.core.codec import check_format
    from rr_client.core.errors import ConfigurationError

    args, fmt, i = list(argv), None, 0
    out: list[str] = []
    while i < len(args):
        a = args[i]
        if a == FORMAT_FLAG:
            if i + 1 >= len(args):
                raise ConfigurationError(f"{FORMAT_FLAG} needs a value (one of {', '.join(FORMATS)})")
            fmt, i = args[i + 1], i + 2
        elif a.startswith(FORMAT_FLAG + "="):
            fmt, i = a.split("=", 1)[1], i + 1
        else:
            out.append(a)
            i += 1
            continue
        fmt = check_format(fmt)
    return out, fmt


def _values(argv: Sequence[str], flag: str) -> list[str]:
    """Every value given to ``flag`` (``--flag v`` or ``--flag=v``)."""
    out = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def _local_path(value: str) -> bool:
    """``value`` names a local folder, not a hub id (``ORG/NAME``): absolute, relative with ``.``, ``~``, or deeper."""
    return value.startswith(("/", ".", "~")) or value.count("/") > 1


def preflight(argv: Sequence[str], parser: argparse.ArgumentParser, engine: str) -> str | None:
    """What is wrong with the launch line of ``engine`` (its name), in one line, before the engine starts (exit 2),
    or None: an ``--rr-*`` option rr does not have (it would reach the engine and fail after its start-up), another
    engine's model flag (vLLM given SGLang's ``--model-path``), a local model folder that does not exist (the engine
    would try the hub and fail seconds later)."""
    rr_flags = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--rr-"))
    for a in argv:
        name = a.split("=", 1)[0]
        if name.startswith("--rr-") and name not in rr_flags:
            close = difflib.get_close_matches(name, rr_flags, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            return f"unknown rr option {name}: {hint}rr's options: {', '.join(rr_flags) or 'none of that form'}"
    eng = find_engine(engine)
    for other in ENGINES.values():
        for flag in other.model_flags:
            if flag not in eng.model_flags and any(a == flag or a.startswith(flag + "=") for a in argv):
                own = eng.model_flags[0]
                return (
                    f"{eng.label} takes {own}, not {flag} ({other.label}'s spelling): "
                    f"rr-server launch {eng.name} {own} <folder or ORG/NAME>"
                )
    for flag in eng.model_flags:
        for v in filter(_local_path, _values(argv, flag)):
            folder = Path(v).expanduser()
            if not folder.is_dir():
                return f"{flag} {v}: no such folder (a local model folder, or a hub id ORG/NAME)"
            if unreadable := _unreadable(folder):
                return (
                    f"{flag} {v}: {unreadable} cannot be read by this user (uid {os.getuid()}); the engine would say "
                    "'No such file'. Make the folder readable (chmod -R a+rX; rr's images run as uid 1000)"
                )
    return None


def _unreadable(folder: Path) -> str | None:
    """The first file directly in ``folder`` (config, weights, tokenizer) this process cannot read, or None."""
    try:
        files = sorted(p for p in folder.iterdir() if p.is_file())
    except OSError:
        return "the folder"
    return next((p.name for p in files if not os.access(p, os.R_OK)), None)
