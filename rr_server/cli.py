"""``rr-server``: launch a patched engine, or run the sidecar in front of an unpatched one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage:
  rr-server launch vllm   <vLLM api_server arguments...>
  rr-server launch sglang <SGLang launch_server arguments...>
  rr-server proxy --upstream URL --engine sglang|vllm [--host H] [--port P]
  rr-server doctor URL [--model-path DIR] [--prompts N] [--json] [--engine vllm|sglang]
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the launcher or the sidecar; engine arguments pass through untouched."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "launch" and args[1] == "vllm":
        from rr_server.launch_vllm import main as launch_vllm

        return launch_vllm(args[2:])
    if len(args) >= 2 and args[0] == "launch" and args[1] == "sglang":
        from rr_server.launch_sglang import main as launch_sglang

        return launch_sglang(args[2:])
    if args and args[0] == "doctor":
        from rr_server.doctor import main as doctor

        return doctor(args[1:])
    if args and args[0] == "proxy":
        from rr_server.proxy import main as proxy

        return proxy(args[1:])
    sys.stderr.write(USAGE)
    return 0 if args[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
