"""scripts/_env.sh: which Python the setup scripts accept and where CPU torch comes from (no network, no install)."""

from __future__ import annotations

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
