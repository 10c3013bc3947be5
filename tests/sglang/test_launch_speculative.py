"""``rr-server launch sglang --speculative-*`` on each real SGLang release: refused before 0.5.23 (draft layers write
the target's rows, sgl-project/sglang#26980); from 0.5.23 (``disable_routed_experts_capture_for_draft``) EAGLE/MTP at
top-k 1 passes through, and a draft tree (NGRAM, or ``--speculative-eagle-topk`` > 1, stated or chosen by SGLang while
resolving its arguments) is refused in one line naming sgl-project/sglang#37949: its verification moves the KV, not
the capture rows (tests/sglang/test_capture_paths.py runs the release's code). With ``--enable-return-indexer-topk``
the launcher turns SGLang's fused indexer top-k off (``SGLANG_DSA_FUSE_TOPK=0``) and refuses an explicit on.
The release is the installed one (scripts/test_sglang.sh's overlay); SGLang's server itself is not started."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rr_client.core.errors import ConfigurationError
from rr_server.launch import sglang as launch_sglang
from rr_server.serving.engines import engine_release
from rr_server.serving.engines.sglang import FUSE_TOPK_ENV, installed_version

pytestmark = pytest.mark.sglang

SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d", "--speculative-num-steps", "2"]


def test_speculative_decoding_refused_exactly_where_drafts_pollute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    rc = launch_sglang.main(["--model-path", "m", *SPEC])
    version = installed_version()
    if engine_release(version) < (0, 5, 23):
        err = capsys.readouterr().err
        assert rc == 2 and not ran
        assert "sgl-project/sglang#26980" in err and "sglang >= 0.5.23" in err and version in err
    else:  # top-k not stated: SGLang chooses it while resolving, checked then (test_a_draft_tree_sglang_chooses...)
        assert rc == 0 and ran and all(a in ran[0] for a in SPEC)


def _launch(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[int, list[list[str]]]:
    """``rr-server launch sglang argv`` with the patch and SGLang's server stood in (nothing started)."""
    ran: list[list[str]] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    return launch_sglang.main(["--model-path", "m", *argv]), ran


TREES = {
    "ngram": ["--speculative-algorithm", "NGRAM"],
    "eagle_topk4": [*SPEC, "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
    "eagle3_topk2": ["--speculative-algorithm=EAGLE3", "--speculative-eagle-topk=2"],
}


@pytest.mark.sglang_since("0.5.23")
@pytest.mark.parametrize("argv", TREES.values(), ids=TREES.keys())
def test_a_speculative_draft_tree_is_refused_in_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, ran = _launch(monkeypatch, argv)
    err = capsys.readouterr().err
    assert rc == 2 and not ran and err.count("\n") == 1
    assert "sgl-project/sglang#37949" in err and "--speculative-algorithm" in err and installed_version() in err
    assert ("NGRAM" in err) if "NGRAM" in argv else ("--speculative-eagle-topk" in err)


@pytest.mark.sglang_since("0.5.23")
def test_eagle_and_mtp_at_topk_1_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in (
        [*SPEC, "--speculative-eagle-topk", "1"],
        ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk=1"],
    ):
        rc, ran = _launch(monkeypatch, argv)
        assert rc == 0 and ran and all(a in ran[0] for a in argv)


def test_a_release_whose_tree_fact_is_unknown_is_refused() -> None:
    """A release rr has not read (0.5.24) is refused with a draft tree, never assumed to move the rows; at top-k 1
    it is not a tree."""
    with pytest.raises(ConfigurationError, match=r"has not read.*sgl-project/sglang#37949"):
        launch_sglang.check_capture_paths("0.5.24", ["--enable-return-routed-experts", *TREES["ngram"]], {})
    launch_sglang.check_capture_paths("0.5.24", [*SPEC, "--speculative-eagle-topk", "1"], {})


@pytest.mark.sglang_since("0.5.23")
def test_a_draft_tree_sglang_chooses_itself_is_refused_once_resolved(tiny_moe: Path, tmp_path: Path) -> None:
    """Without --speculative-num-steps SGLang chooses the draft's top-k while resolving its arguments (0.5.23
    speculative_hook.py _auto_choose_speculative_params: 4 for a Llama target, 1 for Qwen3-MoE); the launcher checks
    SGLang's own resolution of a copy before run_server."""
    from sglang.srt.server_args import prepare_server_args

    llama = tmp_path / "llama-arch"
    shutil.copytree(tiny_moe, llama)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    for model, refused in ((tiny_moe, False), (llama, True)):
        argv = ["--model-path", str(model), "--device", "cpu", "--enable-return-routed-experts"]
        argv += ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(model)]
        sa = prepare_server_args(argv)
        why = launch_sglang.resolved_refusal(sa)
        assert (why is not None) is refused, why
        if refused:
            assert "--speculative-eagle-topk 4" in why and "sgl-project/sglang#37949" in why
        assert not getattr(sa, "_resolution_finished", False)  # the record itself is left to run_server


@pytest.mark.sglang_since("0.5.23")
def test_indexer_capture_turns_the_fused_topk_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--enable-return-indexer-topk: the launcher sets SGLANG_DSA_FUSE_TOPK=0 in the engine's environment (its
    schedulers inherit it), keeps an explicit 0, and refuses an explicit on in one line naming the setting."""
    import os

    monkeypatch.delenv(FUSE_TOPK_ENV, raising=False)
    rc, ran = _launch(monkeypatch, ["--enable-return-indexer-topk"])
    assert rc == 0 and ran and os.environ[FUSE_TOPK_ENV] == "0"
    for value, ok in (("0", True), ("false", True), ("1", False), ("yes", False), ("maybe", False)):
        monkeypatch.setenv(FUSE_TOPK_ENV, value)
        rc, ran = _launch(monkeypatch, ["--enable-return-indexer-topk"])
        err = capsys.readouterr().err
        assert (rc == 0 and bool(ran)) is ok, (value, err)
        if not ok:
            assert rc == 2 and FUSE_TOPK_ENV in err and err.count("\n") == 1
    monkeypatch.setenv(FUSE_TOPK_ENV, "1")  # without indexer capture the fused top-k is none of rr's business
    assert _launch(monkeypatch, [])[0] == 0


def test_without_speculative_flags_nothing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    assert launch_sglang.main(["--model-path", "m"]) == 0 and ran
