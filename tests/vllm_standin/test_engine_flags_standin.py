"""The pre-flight's reading of vLLM's options (rr_server.launch.engine_flags) against vLLM 0.31-0.33's own
``make_arg_parser`` in each stand-in environment (0.30: tests/unit/test_engine_flags.py)."""

from __future__ import annotations

import importlib
import importlib.util

from tests.support.engine_flags_check import check_against


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def test_vllm_options_are_read_from_its_source() -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    places = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")  # 0.33, 0.30-0.32
    found = [m for m in places if _exists(m)]
    make_arg_parser = importlib.import_module(found[0]).make_arg_parser
    known = check_against(make_arg_parser(FlexibleArgumentParser()), "vllm")
    assert {"--model", "--port", "--enable-return-routed-experts"} <= known.flags
