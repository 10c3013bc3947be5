"""The TRL example's and the soak's plots, without a server: matplotlib stays out of every module until a plot is
drawn, a missing matplotlib names the ``rr-replay[plot]`` extra, the PNGs are whole and of the stated size, the TRL
example's panels hold every series and its per-step lines and summary say what the numbers are, and the soak's
progress falls back to plain lines when its stream is not a terminal."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from rr_client.core.errors import MissingDependencyError
from tests.support.png import png_size
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "trl_grpo_r3.py"
SOAK = REPO / "benchmarks" / "soak.py"


def _runs() -> dict[bool, list[dict[str, float]]]:
    """Two arms of three steps, as the example's train() returns TRL's log_history rows (the no-replay arm has no
    applied share) with each step's gap floor."""
    return {
        on: [
            {
                "step": s,
                "loss": 0.01,
                "reward": 3.0,
                "r3/mean_abs_logp_diff": (1.0 if on else 1.5) * 1e-3 * s,
                "gap_floor": 1e-3 * s,
                "r3/k3_kl": 1e-6 * s,
                "r3/agreement": 0.99 if on else 0.98,
                "r3/weight_sync_seconds": 0.1,
                **({"r3/applied_share": 1.0, "r3/applied_share_min_layer": 1.0} if on else {}),
            }
            for s in (1, 2, 3)
        ]
        for on in (True, False)
    }


def test_no_module_imports_matplotlib() -> None:
    code = (
        "import sys, importlib.util\n"
        "import rr_client, rr_server, rr_client.core.optional\n"
        f"for name, path in (('ex', {str(EXAMPLE)!r}), ('soak', {str(SOAK)!r})):\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tqdm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_missing_matplotlib_names_the_plot_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    example, soak = load_script(EXAMPLE, "rr_example_trl"), load_script(SOAK, "rr_bench_soak_plots")
    with pytest.raises(MissingDependencyError, match=r"--plot needs matplotlib: pip install 'rr-replay\[plot\]'"):
        example.plot(_runs(), tmp_path / "x.png", title="t")
    with pytest.raises(MissingDependencyError, match=r"--plot needs matplotlib"):
        example.figure(_runs(), title="t")
    with pytest.raises(MissingDependencyError, match=r"pip install 'rr-replay\[plot\]'"):
        soak.plot_memory([soak.SoakReport(target="t")], tmp_path / "y.png")
    with pytest.raises(MissingDependencyError, match=r"rr-replay\[plot\]"):
        example.main(["--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "z.png")])  # before any training
    assert not any(tmp_path.iterdir())


def test_example_plot_and_numbers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    example = load_script(EXAMPLE, "rr_example_trl")
    png = example.plot(_runs(), tmp_path / "sub" / "r3.png", title="t")
    assert png_size(png) == (1200, 360) and png.stat().st_size > 30_000
    data = example.metrics(_runs(), bf16=True)
    assert data["trainer_dtype"] == "bf16 autocast"
    assert [r["mean_abs_logp_diff"] for r in data["arms"]["no_replay"]] == pytest.approx([1.5e-3, 3e-3, 4.5e-3])
    assert [r["gap_floor"] for r in data["arms"]["no_replay"]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert [r["applied_share_min_layer"] for r in data["arms"]["replay"]] == [1.0] * 3
    assert [r["applied_share"] for r in data["arms"]["replay"]] == [1.0] * 3
    assert [r["applied_share_min_layer"] for r in data["arms"]["no_replay"]] == [None] * 3


def test_example_plot_draws_every_series() -> None:
    """The three panels' lines, per arm and step: the rows that ran the engine's experts (replay: its applied share;
    without: its own matching picks, the agreement), the agreement, and the gap over its floor."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    example = load_script(EXAMPLE, "rr_example_trl")
    fig = example.figure(_runs(), title="t")
    try:
        panels = {ax.get_title(): {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()} for ax in fig.axes}
    finally:
        plt.close(fig)
    assert panels["rows that ran the engine's experts"] == {
        "replay (R3)": [1.0] * 3,
        "no replay (its own matching picks)": [0.98] * 3,
    }
    assert panels["router agreement (own top-k vs engine's)"] == {"replay (R3)": [0.99] * 3, "no replay": [0.98] * 3}
    gap = panels["log-prob gap and its floor"]
    assert set(gap) == {
        "replay (R3): floor",
        "replay (R3): gap, mean +0.00% off its floor",
        "no replay: floor",
        "no replay: gap, mean +50.00% off its floor",
    }
    assert gap["no replay: gap, mean +50.00% off its floor"] == pytest.approx([1.5e-3, 3e-3, 4.5e-3])
    assert gap["replay (R3): floor"] == gap["no replay: floor"] == pytest.approx([1e-3, 2e-3, 3e-3])


def test_example_step_lines_and_summary() -> None:
    """What the example prints per training step as it goes, and its summary of both arms, from the numbers."""
    example = load_script(EXAMPLE, "rr_example_trl")
    runs = _runs()
    on = example.step_line(True, 2, 3, runs[True][1])
    off = example.step_line(False, 2, 3, runs[False][1])
    assert on == "[replay (R3)] step   2/3: reward  3.000  agreement  99.0%  applied  100.0%  gap 0.002 (floor 0.002)"
    assert off == "[  no replay] step   2/3: reward  3.000  agreement  98.0%  applied     off  gap 0.003 (floor 0.002)"
    lines = example.summary(runs)
    assert lines[1].split()[-2:] == ["100.0%", "98.0%"]  # rows that ran the engine's experts
    assert lines[2].split()[-2:] == ["99.0%", "98.0%"]  # the routers' own agreement
    assert lines[4].startswith("  its floor") and lines[4].split()[-2:] == ["0.002", "0.002"]
    assert lines[5].startswith("  gap above the floor") and lines[5].split()[-2:] == ["+0", "+0.001"]
    assert lines[7].startswith("With replay the gap was on its floor (+0.00%); without, off it (+50.00%).")
    assert lines[9].endswith("How far the gap without replay is off its floor is what running other experts changed.")
    on_floor = {**runs, False: [{**h, "r3/mean_abs_logp_diff": h["gap_floor"] * 1.005} for h in runs[False]]}
    said = "\n".join(example.summary(on_floor))
    assert "without, on it (+0.50%)" in said and "did not measurably move the log-probs" in said


def test_soak_plot_and_plain_progress(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    soak = load_script(SOAK, "rr_bench_soak_plots")
    reports = []
    for target, base in (("patched", 1900.0), ("sidecar", 1950.0)):
        r = soak.SoakReport(
            target=target, warmup=20, rss_mb={"tree": {"start": base, "warm-up": base + 5, "end": base + 30}}
        )
        r.samples = [(n, base + n / 4) for n in range(20, 140, 20)]
        reports.append(r)
    png = soak.plot_memory(reports, tmp_path / "soak.png", title="t")
    assert png_size(png) == (800, 400) and png.stat().st_size > 10_000

    log = io.StringIO()
    progress = soak.Progress("patched", 10, every=4, stream=log)
    assert progress.bar is None  # a StringIO is no terminal
    for done in range(1, 11):
        progress.update(done, 123.0 if done == 6 else None)
    progress.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" units")[0] for line in lines] == ["patched: 4/10", "patched: 8/10", "patched: 10/10"]
    assert "RSS" not in lines[0] and lines[1].endswith("RSS 123 MiB") and lines[2].endswith("RSS 123 MiB")

    short = io.StringIO()  # stopped by --duration-limit before its total: the last count is still printed, once
    progress = soak.Progress("sidecar", 10, every=4, stream=short)
    for done in range(1, 7):
        progress.update(done)
    progress.close()
    progress.close()
    assert [line.split(" units")[0] for line in short.getvalue().splitlines()] == ["sidecar: 4/10", "sidecar: 6/10"]
