"""verl's legacy FSDP worker (issue 44): ``verl.workers.fsdp_workers.ActorRolloutRefWorker`` and its
``AsyncActorRolloutRefWorker``, what verl 0.5-0.7's ``main_ppo`` runs for fsdp/fsdp2 by default
(``trainer.use_legacy_worker_impl=auto``; verl 0.8 removed it). It has no routing replay and rr does not replay in
it, so with replay asked it must refuse to start, never train unreplayed.

verl's own classes: verl 0.7.1 from PyPI as an overlay on ``.venvs/verl`` (scripts/setup_verl_legacy.sh), in fresh
processes (one verl per interpreter). verl 0.7.1 loads no ``verl.plugins`` entry point (that came in 0.9.0): rr
comes in through verl's own ``VERL_USE_EXTERNAL_MODULES``, or by calling ``install()`` after verl's import.
Stand-in, named: a one-process gloo group for Ray's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEGACY_VERL = "0.7.1"
OVERLAY = ROOT / ".venvs" / f"verl-legacy-{LEGACY_VERL}"  # scripts/setup_verl_legacy.sh --pythonpath
PLUGIN = "rr_client.integrations.verl._plugin"

# verl's legacy AsyncActorRolloutRefWorker (role actor_rollout) built from verl 0.7.1's generated PPO config, per
# case: ["built"] (verl's own __init__ ran to its end) or [error, message]; printed as the last stdout line
_BUILD = r"""
import json, logging, os, sys
from pathlib import Path
records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("rr_client").addHandler(_Keep())
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
import torch.distributed as dist
dist.init_process_group("gloo")
import verl
{setup}
from omegaconf import OmegaConf
from verl.workers.fsdp_workers import ActorRolloutRefWorker, AsyncActorRolloutRefWorker
from rr_client.core.patching import is_wrapped

def config(strategy="fsdp2", rr=None, verl_mode=None, rollout=False):
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    OmegaConf.set_struct(cfg, False)
    a = cfg.actor_rollout_ref
    a.model.path = os.environ["RR_TEST_MODEL_DIR"]
    a.actor.strategy = strategy
    if rr is not None:  # rr's switch (+actor_rollout_ref.actor.fsdp_config.router_replay.mode)
        a.actor.fsdp_config.router_replay = {{"mode": rr}}
    if verl_mode is not None:  # verl 0.7's own (read by its Megatron worker only)
        a.actor.router_replay.mode = verl_mode
    a.rollout.enable_rollout_routing_replay = rollout
    return a

def build(**kw):
    try:
        AsyncActorRolloutRefWorker(config=config(**kw), role="actor_rollout")
    except Exception as e:
        return [type(e).__name__, " ".join(str(e).split())]
    return ["built"]

cases = {cases!r}
print(json.dumps({{
    "verl": verl.__version__, "records": records, "plugin": "{plugin}" in sys.modules,
    "wrapped": is_wrapped(ActorRolloutRefWorker, "__init__"),
    "workers": {{name: build(**kw) for name, kw in cases.items()}},
}}))
"""

ASKED = {
    "rr_R3": (dict(rr="R3", rollout=True), "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3"),
    "rr_R2": (dict(rr="R2"), "actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2"),
    "verl_R3_fsdp1": (dict(strategy="fsdp", verl_mode="R3"), "actor_rollout_ref.actor.router_replay.mode=R3"),
    "rollout_rows": (dict(rollout=True), "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
}


def legacy_workers(model_dir: Path, setup: str, env: dict[str, str], cases: dict[str, dict[str, Any]]) -> Any:
    """Build verl 0.7.1's legacy worker per case in a fresh interpreter; its report."""
    if not (OVERLAY / "verl" / "workers" / "fsdp_workers.py").is_file():
        pytest.fail(f"verl {LEGACY_VERL}'s overlay is missing at {OVERLAY}: run scripts/setup_verl_legacy.sh")
    from rr_server.launch.process import free_port

    skip = ("RR_ALLOW_UNSUPPORTED_VERSION", "VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")
    e = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith(("RANK", "WORLD_", "LOCAL_"))}
    e.update(PYTHONPATH=f"{OVERLAY}{os.pathsep}{ROOT}", RR_TEST_MODEL_DIR=str(model_dir), MASTER_PORT=str(free_port()))
    e.update(env)
    code = _BUILD.format(setup=setup, cases=cases, plugin=PLUGIN)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["verl"] == LEGACY_VERL, got["verl"]
    return got


def assert_refused(workers: dict[str, Any]) -> None:
    """Every case that asks for replay raised, naming the setting, the legacy worker's switch and the way out."""
    for case, (_kw, asked) in ASKED.items():
        kind, why = workers[case]
        assert kind == "UnsupportedVersionError", (case, workers[case])
        for part in (
            asked,
            "verl's legacy FSDP worker (verl.workers.fsdp_workers.ActorRolloutRefWorker",
            "trainer.use_legacy_worker_impl=disable",
            "train unreplayed",
            "upgrade verl to 0.9.1",
            "router_replay.mode=disabled",
        ):
            assert part in why, (case, part, why)


def test_the_legacy_worker_asked_for_replay_refuses_to_start(model_dir: Path) -> None:
    """rr loaded as verl 0.7.1 loads external code (``VERL_USE_EXTERNAL_MODULES``): one warning (an untested verl),
    the legacy worker's ``__init__`` guarded; every config asking for replay (rr's switch, verl's own
    ``actor.router_replay.mode``, the rollout's rows; fsdp2 and FSDP1) raises ``UnsupportedVersionError`` before
    verl builds anything, and replay disabled is verl's own worker, built."""
    cases = {name: kw for name, (kw, _) in ASKED.items()} | {"disabled": {}}
    got = legacy_workers(model_dir, "", {"VERL_USE_EXTERNAL_MODULES": PLUGIN}, cases)
    assert got["plugin"] and got["wrapped"]
    assert [r[0] for r in got["records"]] == ["WARNING"] and "verl 0.7.1" in got["records"][0][1], got["records"]
    assert got["workers"]["disabled"] == ["built"], got["workers"]
    assert_refused(got["workers"])


def test_stock_verl_trains_the_legacy_worker_unreplayed_and_rr_installed_late_guards_it(model_dir: Path) -> None:
    """What rr's guard is for: stock verl 0.7.1 (rr not loaded) builds the legacy worker asked for R3, to train
    unreplayed without a word. ``install()`` after ``verl.workers.fsdp_workers`` was imported guards it all the same,
    and so does ``RR_ALLOW_UNSUPPORTED_VERSION=1`` (it patches verl's engine worker, never the legacy one)."""
    stock = legacy_workers(model_dir, "", {}, {"rr_R3": ASKED["rr_R3"][0]})
    assert not stock["plugin"] and not stock["wrapped"]
    assert stock["workers"] == {"rr_R3": ["built"]}  # the silent failure
    late = legacy_workers(
        model_dir,
        "import verl.workers.fsdp_workers\nimport rr_client.integrations.verl as _rr\n_rr.install()",
        {"RR_ALLOW_UNSUPPORTED_VERSION": "1"},
        {name: kw for name, (kw, _) in ASKED.items()},
    )
    assert late["wrapped"] and not late["plugin"]
    assert_refused(late["workers"])


def test_the_legacy_guard_is_installed_on_every_release() -> None:
    """In verl 0.9.1 (no legacy module) the post-import hook waits for ``verl.workers.fsdp_workers`` all the same,
    beside every patch, and refuses a config in the legacy worker's terms without needing the module."""
    import rr_client.integrations.verl as rr
    from rr_client.core.errors import UnsupportedVersionError
    from rr_client.integrations.verl import _patches

    rr.install()
    assert rr.installed() and rr._finder is not None
    assert set(rr._finder.actions) == {*_patches.PATCHES, _patches.LEGACY_WORKERS_MODULE}
    actor = {"strategy": "fsdp2", "fsdp_config": {}, "router_replay": {"mode": "R2"}}
    with pytest.raises(UnsupportedVersionError, match=r"actor\.router_replay\.mode=R2 .*use_legacy_worker_impl"):
        _patches.refuse_legacy_worker({"actor": actor, "rollout": {}})
    for off in ({**actor, "router_replay": {"mode": "disabled"}}, {**actor, "strategy": "megatron"}):
        _patches.refuse_legacy_worker({"actor": off, "rollout": {}})  # nothing asked on FSDP: verl's own worker
