"""``rr-server launch sglang <SGLang args>``: install rr's patch, then run SGLang's own launch_server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any

from rr_client.core.errors import ConfigurationError
from rr_server.launch.bounded_replay import ALLOW_FLAG as BOUNDED_REPLAY_FLAG
from rr_server.launch.bounded_replay import check_bounded_replay
from rr_server.launch.options import (
    add_shared_options,
    engine_help,
    launcher_parser,
    preflight,
    take_rr_settings,
    wants_help,
)
from rr_server.serving.capture_paths import INDEXER_CAPTURE, argv_view, indexer_refusal, tree_verify_refusal
from rr_server.serving.disaggregation import disaggregation_mode, sglang_pd_refusal
from rr_server.serving.engines.sglang import RELEASES, UnsupportedSGLangError
from rr_server.serving.speculative import draft_pollution_refusal, speculative_flags

__all__ = [
    "main",
    "build_parser",
    "prepare_argv",
    "install_patch",
    "HICACHE_FLAG",
    "check_hicache",
    "bounded_replay",
    "check_capture_paths",
    "resolved_refusal",
]

logger = logging.getLogger("rr.sglang")
FLAG = "--enable-return-routed-experts"
# entry-point group through which launchers reach rr's engine patches (never by importing rr_patches)
LAUNCH_PATCHES = "rr.launch_patches"
HICACHE_FLAG = "--enable-hierarchical-cache"
# SGLang releases that refuse HiCache + routed experts at startup themselves (the guard that comes with #39027);
# none of 0.5.7 - 0.5.23 does, so rr refuses it on all of them
HICACHE_REFUSED_BY_SGLANG: frozenset[str] = frozenset()
# rr's own flags, taken out before SGLang parses (--routed-experts-format has its own parser)
_RR_FLAGS = (BOUNDED_REPLAY_FLAG,)


def build_parser() -> argparse.ArgumentParser:
    """rr's own options of ``rr-server launch sglang``, for ``--help`` and the docs (SGLang's pass through)."""
    p, group = launcher_parser(
        "SGLang",
        "SGLang launch_server",
        "Start SGLang's own server (prepare_server_args + run_server) with rr's patch installed: rr's wire format on "
        f"/generate and the OpenAI endpoints, GET /rr/info; adds {FLAG} when missing. Refuses an SGLang outside "
        f"{RELEASES.help_range}, --tokenizer-worker-num > 1, {HICACHE_FLAG} (sglang#26975), --speculative-* where "
        "drafts pollute the routing, a speculative draft tree (NGRAM, --speculative-eagle-topk > 1: sglang#37949), "
        "an explicit SGLANG_DSA_FUSE_TOPK=1 with --enable-return-indexer-topk (which it sets to 0), and "
        "DeepSeek-V4.1 with decoder SWA bounded replay on (SGLang 0.5.23's default; exit 2).",
    )
    group.add_argument(
        BOUNDED_REPLAY_FLAG,
        action="store_true",
        help="serve DeepSeek-V4.1 with SWA bounded replay on (refused otherwise: its log-probs and prompt rows "
        "are not a full prefill's; --no-enable-decoder-swa-bounded-replay turns it off)",
    )
    add_shared_options(group, "SGLang")
    return p


def _sglang_help() -> None:
    """SGLang's own ``launch_server --help`` (its parser prints and exits)."""
    from sglang.srt.server_args import prepare_server_args

    prepare_server_args(["--help"])


def prepare_argv(argv: Sequence[str]) -> list[str]:
    """SGLang's arguments with ``--enable-return-routed-experts`` added when missing."""
    args = list(argv)
    if FLAG not in args and not any(a.startswith(FLAG + "=") for a in args):
        args.append(FLAG)
    return args


def _tokenizer_workers(args: Sequence[str]) -> int:
    """Value of ``--tokenizer-worker-num`` (1 when absent or unparsable)."""
    for i, a in enumerate(args):
        if a == "--tokenizer-worker-num" and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith("--tokenizer-worker-num="):
            val = a.split("=", 1)[1]
        else:
            continue
        try:
            return int(val)
        except ValueError:
            return 1
    return 1


def check_hicache(version: str, argv: Sequence[str]) -> None:
    """ConfigurationError when ``argv`` turns SGLang's hierarchical cache on with routed experts on a release that
    does not refuse the pair itself: prompt rows restored from the host tier are other rows (sgl-project/sglang
    #26975) that keep their shape and id range, until #39027 moves the rows with the KV pages."""
    from rr_client.core.errors import ConfigurationError

    if version in HICACHE_REFUSED_BY_SGLANG:
        return  # SGLang's own startup check refuses it, in its own words
    if any(
        a == HICACHE_FLAG or a.startswith(HICACHE_FLAG + "=") and a.split("=", 1)[1].lower() not in ("0", "false")
        for a in argv
    ):
        raise ConfigurationError(
            f"SGLang {version} with {HICACHE_FLAG} and routed experts: prompt rows restored from the host/storage "
            "tier are other requests' rows, silently - same shape and id range (sgl-project/sglang#26975; the fix, "
            "#39027, is not in this release). Serve without the hierarchical cache"
        )


def check_capture_paths(version: str, argv: Sequence[str], env: MutableMapping[str, str]) -> None:
    """ConfigurationError (one line, naming the flags and the upstream issue) when ``argv`` captures rows on a path
    whose rows are wrong but well formed on SGLang ``version`` (rr_server.serving.capture_paths): a speculative draft
    tree (NGRAM, or a stated ``--speculative-eagle-topk`` > 1; sgl-project/sglang#37949), or indexer capture with the
    fused top-k stated on. With indexer capture, sets ``SGLANG_DSA_FUSE_TOPK=0`` in ``env`` (the engine's
    environment: its scheduler processes inherit it), so the indexer picks are token positions."""
    from rr_server.serving.engines.sglang import FUSE_TOPK_ENV, fuse_topk

    view = argv_view(RELEASES.name, argv)
    if why := tree_verify_refusal(RELEASES.name, version, view, resolved=False):
        raise ConfigurationError(why)
    if not view[INDEXER_CAPTURE[1]]:
        return
    try:
        fused = fuse_topk(env) if FUSE_TOPK_ENV in env else False
    except ValueError as e:
        raise ConfigurationError(f"{e}; with {INDEXER_CAPTURE[0]} rr needs it off (0)") from None
    if why := indexer_refusal(RELEASES.name, version, view, fused):
        raise ConfigurationError(why)
    env[FUSE_TOPK_ENV] = "0"


def resolved_refusal(server_args: Any) -> str | None:
    """:func:`tree_verify_refusal` on SGLang's resolved arguments: a draft top-k SGLang chooses itself (0.5.23
    arg_groups/speculative_hook.py _auto_choose_speculative_params: 4 for Llama and Grok drafts) is known only then.
    Resolves a copy (``run_server`` resolves the record itself); a copy SGLang cannot resolve is left to its own
    error."""
    import copy

    from rr_server.serving.engines.sglang import installed_version

    if not hasattr(server_args, "resolve_once"):  # before 0.5.23 the record is its own resolved view
        return tree_verify_refusal(RELEASES.name, installed_version(), vars(server_args), resolved=True)
    probe = copy.deepcopy(server_args)
    try:
        probe.resolve_once()
    except Exception:  # noqa: BLE001 - run_server resolves the record again and reports SGLang's own error
        return None
    return tree_verify_refusal(RELEASES.name, installed_version(), probe.resolved_dict(), resolved=True)


def bounded_replay(argv: Sequence[str], *, allow: bool) -> str | None:
    """:func:`rr_server.launch.bounded_replay.check_bounded_replay` on the installed SGLang (ConfigurationError when
    refused; the warning to log, or None). Without SGLang installed there is nothing to check."""
    from importlib.metadata import PackageNotFoundError

    from rr_server.serving.engines.sglang import installed_version

    try:
        version = installed_version()
    except PackageNotFoundError:
        return None
    return check_bounded_replay(RELEASES.name, version, argv, allow=allow)


def install_patch() -> str:
    """Patch this process the way an installed rr reaches SGLang: rr's ``rr.launch_patches`` entry point.

    The launcher never imports :mod:`rr_patches` (the adapters sit beside it, not below it); returns how it patched.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=LAUNCH_PATCHES) if ep.name == RELEASES.name]
    if not found:
        raise UnsupportedSGLangError(
            f"rr's SGLang patch is not installed (no '{LAUNCH_PATCHES}: sglang' entry point): pip install rr-replay"
        )
    return str(found[0].load()())


def _run(argv: list[str]) -> None:
    """SGLang's own ``prepare_server_args`` + ``run_server``, with its own cleanup."""
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args: Any = prepare_server_args(argv)
    if why := resolved_refusal(server_args):
        raise ConfigurationError(why)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def _installed() -> str | None:
    """The installed SGLang's release, None when there is none."""
    from rr_server.serving.engines import sglang as releases

    try:
        return releases.installed_version()
    except ImportError:  # PackageNotFoundError
        return None


def main(argv: Sequence[str]) -> int:
    """Entry point used by ``rr-server launch sglang``; returns a process exit code."""

    if wants_help(argv):  # rr's options, then SGLang's: nothing is patched or started
        return engine_help(build_parser(), "SGLang", "sglang", _sglang_help)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (wrong := preflight(argv, build_parser(), "sglang", _installed())) is not None:
        sys.stderr.write(f"rr-server: {wrong}\n")
        return 2
    try:  # read by the patched server in this process: the format per request, the store once
        argv, rr_env = take_rr_settings(argv)
    except ValueError as e:
        sys.stderr.write(f"rr-server: {e}\n")
        return 2
    os.environ.update(rr_env)
    allow_replay = BOUNDED_REPLAY_FLAG in argv
    args = prepare_argv([a for a in argv if a not in _RR_FLAGS])
    if _tokenizer_workers(args) > 1:
        sys.stderr.write(
            "rr-server: --tokenizer-worker-num > 1 is not supported: SGLang then runs its TokenizerManagers "
            "in spawned uvicorn worker processes that rr's patch does not reach, so answers would not be in "
            "rr format. Use one tokenizer worker, or run the rr sidecar in front of SGLang.\n"
        )
        return 2
    if any(a.startswith(HICACHE_FLAG) for a in args):
        from rr_server.serving.engines.sglang import installed_version

        try:
            check_hicache(installed_version(), args)
        except ValueError as e:  # ConfigurationError
            sys.stderr.write(f"rr-server: {e}\n")
            return 2
    try:
        if warning := bounded_replay(args, allow=allow_replay):
            logger.warning(warning)
    except ValueError as e:  # ConfigurationError
        sys.stderr.write(f"rr-server: {e}\n")
        return 2
    if disaggregation_mode(args):
        from rr_server.serving.engines.sglang import installed_version

        if why := sglang_pd_refusal(installed_version(), args):
            sys.stderr.write(f"rr-server: {why}\n")
            return 2
    if speculative_flags(args):
        from rr_server.serving.engines.sglang import installed_version

        why = draft_pollution_refusal(RELEASES.name, installed_version(), args)
        if why:
            sys.stderr.write(f"rr-server: {why}\n")
            return 2
    if speculative_flags(args) or argv_view(RELEASES.name, args)[INDEXER_CAPTURE[1]]:
        from rr_server.serving.engines.sglang import installed_version

        try:
            check_capture_paths(installed_version(), args, os.environ)
        except ConfigurationError as e:
            sys.stderr.write(f"rr-server: {e}\n")
            return 2
    try:
        how = install_patch()
    except UnsupportedSGLangError as e:
        sys.stderr.write(f"rr-server: {e}\n")
        return 2
    logger.info("rr: SGLang patched by %s; arguments: %s", how, " ".join(args))
    from rr_server.serving.engines.sglang import ORIGINAL_LOGPROB_ENV, logprobs_mode

    if logprobs_mode() == "raw":
        logger.warning(
            "rr: %s is set: SGLang's sampled log-probs are before temperature (/rr/info logprobs_mode "
            "raw); trainers refuse them at temperature != 1",
            ORIGINAL_LOGPROB_ENV,
        )
    try:
        _run(args)
    except ConfigurationError as e:  # a draft tree SGLang chose while resolving its arguments
        sys.stderr.write(f"rr-server: {e}\n")
        return 2
    return 0
