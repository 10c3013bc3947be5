"""The options and help both launchers share (``rr-server launch vllm|sglang``): rr's ``--routed-experts-format``,
``--help`` that prints rr's options before the engine's own, and taking rr's flag out before the engine parses."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rr_client.core.codec import FORMATS
from rr_client.core.engines import ENGINES
from rr_server.launch.engine_flags import model_given, scan_engine_flags, unknown_flag
from rr_server.serving.command_line import did_you_mean, port_problem
from rr_server.serving.store.install import STORE_ENV

if TYPE_CHECKING:
    from rr_server.serving.engines import EngineReleases

__all__ = [
    "FORMAT_FLAG",
    "launcher_parser",
    "add_shared_options",
    "wants_help",
    "engine_help",
    "take_format_flag",
    "take_store_flag",
    "take_rr_settings",
    "preflight",
    "model_folder_problem",
    "local_path",
    "drop_option",
]

# rr's own flag (not the engine's): the default routed_experts_format of /generate and the OpenAI endpoints
FORMAT_FLAG = "--routed-experts-format"
STORE_FLAG = "--rr-store"


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
    group.add_argument(
        STORE_FLAG,
        metavar="URL",
        help="where rows for refs are held (RR_ROUTING_STORE): memory (the default), ray, or an object store "
        "URL, s3://bucket/prefix or file:///shared/path, whose refs outlive the server (rr-replay[objects]; "
        "credentials from the environment or fsspec's configuration)",
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


def _take_option(argv: Sequence[str], flag: str, missing: str, *, dash_is_missing: bool) -> tuple[list[str], list[str]]:
    """``argv`` without ``flag`` (``--flag v`` or ``--flag=v``), and every value it was given, in order;
    ConfigurationError ``missing`` for a bare flag at the end (or, with ``dash_is_missing``, before another option)."""
    from rr_client.core.errors import ConfigurationError

    out: list[str] = []
    values: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv) or (dash_is_missing and argv[i + 1].startswith("--")):
                raise ConfigurationError(missing)
            values.append(argv[i + 1])
            i += 2
        elif a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
            i += 1
        else:
            out.append(a)
            i += 1
    return out, values


def take_format_flag(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """Remove ``--routed-experts-format {npy,sglang,ref}`` (SGLang's parser would refuse it); ConfigurationError (a
    ValueError) on a missing or bad value (each value given is checked; the last one counts)."""
    from rr_client.core.codec import check_format

    out, values = _take_option(
        argv, FORMAT_FLAG, f"{FORMAT_FLAG} needs a value (one of {', '.join(FORMATS)})", dash_is_missing=False
    )
    return out, [check_format(v) for v in values][-1] if values else None


def take_store_flag(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """Remove ``--rr-store URL`` (the engine's parser would refuse it); its value checked: ``memory``, ``ray``, or an
    object store URL whose filesystem is installed. ConfigurationError (a ValueError) naming what is wrong."""
    out, values = _take_option(
        argv, STORE_FLAG, f"{STORE_FLAG} needs a value: memory, ray, s3://bucket/prefix or file:///path",
        dash_is_missing=True,
    )  # fmt: skip
    if not values:
        return out, None
    from rr_server.serving.store.install import check_store_setting

    return out, check_store_setting(values[-1])


def take_rr_settings(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` without rr's value-taking launch options (``--routed-experts-format``, ``--rr-store``), and the
    environment the serving processes read them from; ConfigurationError naming the option, for either launcher."""
    from rr_client.core.errors import ConfigurationError
    from rr_server.serving.generate_protocol import FORMAT_ENV

    env: dict[str, str] = {}
    try:
        argv, fmt = take_format_flag(argv)
    except ConfigurationError as e:
        raise ConfigurationError(f"{FORMAT_FLAG}: {e}") from None
    if fmt is not None:
        env[FORMAT_ENV] = fmt
    argv, store = take_store_flag(argv)
    if store is not None:
        env[STORE_ENV] = store
    return argv, env


def _values(argv: Sequence[str], flag: str) -> list[str]:
    """Every value given to ``flag`` (``--flag v`` or ``--flag=v``)."""
    out = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def local_path(value: str) -> bool:
    """``value`` names a local folder, not a hub id (``ORG/NAME``): absolute, relative with ``.``, ``~``, or deeper."""
    return value.startswith(("/", ".", "~")) or value.count("/") > 1


def preflight(argv: Sequence[str], parser: argparse.ArgumentParser, engine: str, version: str | None) -> str | None:
    """What is wrong with the launch line of ``engine`` (its name), in one line, before the engine loads (exit 2), or
    None. In order: the engine not installed (with the install command); an ``--rr-*`` option rr does not have;
    another engine's model flag (vLLM given SGLang's ``--model-path``); an option the engine's parser does not have,
    with the closest it has (:mod:`rr_server.launch.engine_flags`; SGLang's indexer capture asked of vLLM says where
    it is); no model at all (vLLM would try its default from the hub); a local model folder that does not exist or
    cannot be read; a port out of range or already taken. ``version``: the installed release as the launcher found
    it (None: not installed); the options are read from the installed source only when it is that release."""
    from rr_server.serving.engines import releases

    rel = releases(engine)
    eng = rel.wire
    if version is None:
        return f"{eng.label} is not installed in this Python ({sys.executable}): {rel.install_hint}"
    rr_flags = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--rr-"))
    for a in argv:
        name = a.split("=", 1)[0]
        if name.startswith("--rr-") and name not in rr_flags:
            hint = did_you_mean(name, rr_flags)
            return f"unknown rr option {name}:{hint} rr's options: {', '.join(rr_flags) or 'none of that form'}"
    for other in ENGINES.values():
        for flag in other.model_flags:
            if flag not in eng.model_flags and any(a == flag or a.startswith(flag + "=") for a in argv):
                own = eng.model_flags[0]
                return (
                    f"{eng.label} takes {own}, not {flag} ({other.label}'s spelling): "
                    f"rr-server launch {eng.name} {own} <folder or ORG/NAME>"
                )
    # rr's own options and whether each takes a value, from the parser (a switch's nargs is 0)
    mine = {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}
    engine_argv = _without(argv, mine)
    known = scan_engine_flags(rel.package, rel.flag_sources) if _source_is(rel, version) else None
    if known is not None and (unknown := unknown_flag(engine_argv, known, rel.underscore_flags)) is not None:
        return _unknown_option(eng.label, eng.name, *unknown)
    if not model_given(engine_argv, eng.model_flags, eng.positional_model, known):
        return f"no model given: rr-server launch {eng.name} {eng.model_flags[0]} <local folder or ORG/NAME>"
    for flag in eng.model_flags:
        for v in filter(local_path, _values(argv, flag)):
            if (why := model_folder_problem(v)) is not None:
                return f"{flag} {v}: {why}"
    return port_problem(_last(engine_argv, "--port"), _last(engine_argv, "--host"), rel.default_port, rel.default_host)


def _source_is(rel: EngineReleases, version: str) -> bool:
    """The engine source on disk is release ``version`` (a launcher told of another one reads no options from it)."""
    try:
        return rel.installed_version() == version
    except ImportError:  # SGLang's says PackageNotFoundError
        return False


def _unknown_option(label: str, name: str, option: str, close: list[str]) -> str:
    """The one line for an option the engine does not have."""
    from rr_server.serving.capture_paths import INDEXER_CAPTURE

    if option == INDEXER_CAPTURE[0]:
        return (
            f"{label} cannot return the sparse-attention indexer's picks ({option} is SGLang's): serve indexer "
            "replay with rr-server launch sglang (SGLang 0.5.23+)"
        )
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{label} has no option {option}: {hint}(rr-server launch {name} --help lists them)"


def drop_option(args: Sequence[str], flag: str, takes_value: bool) -> list[str]:
    """``args`` without ``flag`` (``--flag``, ``--flag=v``, and with ``takes_value`` the word after a bare one)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = takes_value
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def _without(argv: Sequence[str], options: dict[str, bool]) -> list[str]:
    """``argv`` less rr's own ``options`` (each: whether it takes a value) and their values."""
    out = list(argv)
    for option, takes_value in options.items():
        out = drop_option(out, option, takes_value=takes_value)
    return out


def _last(argv: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag``, or None."""
    values = _values(argv, flag)
    return values[-1] if values else None


def model_folder_problem(value: str) -> str | None:
    """Why the local model folder ``value`` cannot be served, in a clause, or None: missing, not a folder, a file in
    it this user cannot read (the engine would say 'No such file'), no ``config.json``."""
    folder = Path(value).expanduser()
    if not folder.is_dir():
        return "no such folder (a local model folder, or a hub id ORG/NAME)"
    if unreadable := _unreadable(folder):
        return (
            f"{unreadable} cannot be read by this user (uid {os.getuid()}); the engine would say 'No such file'. "
            "Make the folder readable (chmod -R a+rX; rr's images run as uid 1000)"
        )
    if not (folder / "config.json").is_file():
        return "no config.json in it (a Hugging Face model folder has one)"
    return None


def _unreadable(folder: Path) -> str | None:
    """The first file directly in ``folder`` (config, weights, tokenizer) this process cannot read, or None."""
    try:
        files = sorted(p for p in folder.iterdir() if p.is_file())
    except OSError:
        return "the folder"
    return next((p.name for p in files if not os.access(p, os.R_OK)), None)
