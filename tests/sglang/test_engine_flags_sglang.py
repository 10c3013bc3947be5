"""The pre-flight's reading of SGLang's options (rr_server.launch.engine_flags) against each release's own
``ServerArgs.add_cli_args``: the source layout moved (server_args.py alone until 0.5.11, arg_groups/ from 0.5.12,
most fields out of server_args.py from 0.5.19), so every release checks its own."""

from __future__ import annotations

import argparse

import pytest

from tests.support.engine_flags_check import check_against

pytestmark = pytest.mark.sglang


def test_sglang_options_are_read_from_its_source() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = check_against(parser, "sglang")
    assert {"--model-path", "--port", "--enable-return-routed-experts"} <= known.flags
