"""``rr-server``: launch a patched engine, run the sidecar in front of an unpatched one, or check a server."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from rr_client.core.engines import ENGINES

HELP = """usage: rr-server <command> [arguments...]
       rr-server <command> --help     (a command's own options; the launchers then show the engine's)

Routed-experts replay (R3): every token's routed experts from SGLang or vLLM, checked and compact.

commands:
  launch vllm ARGS...    start vLLM's OpenAI API server with rr's plugin: POST /generate, GET /rr/info and
                         routing on /v1/completions and /v1/chat/completions; ARGS are vLLM's own
  launch sglang ARGS...  start SGLang's server with rr's patch (rr's wire format on /generate and the OpenAI
                         endpoints); ARGS are SGLang's own launch_server arguments
  proxy                  the sidecar: rr's endpoints in front of an unpatched vLLM or SGLang started with
                         --enable-return-routed-experts (--upstream URL --engine vllm|sglang)
  doctor URL             check, in seconds, that a running server's routing is right (live checks, ground
                         truth against the checkpoint with --model-path, cost); exit 0 on PASS, 1 on FAIL
  ray-stores             list the Ray routing store actors (RR_ROUTING_STORE=ray) on a cluster; remove
                         leftovers (--remove NAME..., --remove-leftovers)

options:
  -h, --help             this help
  --version              print rr-server's version and exit

Try it without a GPU: `make demo` (python -m rr_server.demo) builds a tiny MoE, serves it with vLLM on CPU and
runs the doctor. Docs: README.md and docs/ (engines.md, sidecar.md, doctor.md).
"""


def _version() -> str:
    from rr_client import __version__

    return f"rr-server {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the launcher, the sidecar or the doctor; engine arguments pass through untouched."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "launch" and args[1] in ENGINES:  # rr_server.launch.<engine> launches it
        from rr_server.launch import sglang, vllm  # noqa: F401 - imported by name here, so the import graph sees them

        launch: Callable[[list[str]], int] = importlib.import_module(f"rr_server.launch.{args[1]}").main
        return launch(args[2:])
    if args and args[0] == "doctor":
        from rr_server.doctor import main as doctor

        return doctor(args[1:])
    if args and args[0] == "proxy":
        from rr_server.proxy import main as proxy

        return proxy(args[1:])
    if args and args[0] == "ray-stores":
        from rr_server.ray_stores import main as ray_stores

        return ray_stores(args[1:])
    if args[:1] == ["--version"]:
        print(_version())
        return 0
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(HELP)
        return 0
    sys.stderr.write(f"rr-server: {_unknown(args)} (rr-server --help lists the commands)\n")
    return 2


COMMANDS = ("launch", "proxy", "doctor", "ray-stores")


def _unknown(args: Sequence[str]) -> str:
    """What is wrong with a command line no command takes, with the closest command."""
    from rr_server.serving.command_line import did_you_mean

    if not args:
        return "no command given"
    if args[0] == "launch":
        engine = args[1] if len(args) > 1 else ""
        names = [f"launch {name}" for name in ENGINES]
        if not engine:
            return f"launch needs an engine: {' or '.join(names)}"
        return f"no engine {engine!r} to launch:{did_you_mean(engine, list(ENGINES)) or ' ' + ' or '.join(names)}"
    close = did_you_mean(args[0], [*COMMANDS, "--help", "--version"])
    return f"unknown command {args[0]!r}" + (f":{close}" if close else "")


if __name__ == "__main__":
    sys.exit(main())
