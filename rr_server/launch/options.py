"""The options and help both launchers share (``rr-server launch vllm|sglang``): rr's ``--routed-experts-format``,
``--help`` that prints rr's options before the engine's own, and taking rr's flag out before the engine parses."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence

from rr_client.core.codec import FORMATS

__all__ = ["FORMAT_FLAG", "launcher_parser", "add_shared_options", "wants_help", "engine_help", "take_format_flag"]

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
