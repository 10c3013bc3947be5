"""rr in verl, gated and contained: an untested verl is left unpatched, a patch that no longer fits is left out
alone, FSDP1 with replay is refused, and the multi-turn and SGLang patches leave every other setting to verl. Where
rr's replay is not active (an untested verl, a failed patch) a worker asked for R2/R3 on FSDP raises, never trains
unreplayed.

The gate and the failing patches run in fresh processes that ``import verl`` with rr's ``verl.plugins`` entry point
active (as every verl process does), so verl's own plugin loader and import are what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rr_client.core.errors import ConfigurationError
from tests.verl import harness as h
from tests.verl.test_multi_turn import ScriptedServer, agent_data, rows, run_turns

ROOT = Path(__file__).resolve().parents[2]

# verl's four targets as seen in a fresh process, printed as one JSON line (stdout's last)
_REPORT = r"""
import json, sys
import verl.workers.engine_workers, verl.experimental.agent_loop.tool_agent_loop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine_workers import ActorRolloutRefWorker
import rr_client.integrations.verl as rr
from rr_client.integrations.verl import _patches
from rr_client.core.patching import MARKER, is_wrapped
try:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer
    sglang = is_wrapped(SGLangHttpServer, "generate")
except ImportError:  # no SGLang in this env: verl's server module does not import
    sglang = None
print(json.dumps({
    "records": records, "plugin": "rr_client.integrations.verl._plugin" in sys.modules,
    "installed": rr.installed(), "guarded": rr.guarded(), "failed": rr.failed_patches(),
    "workers": globals().get("workers"),
    "worker": is_wrapped(ActorRolloutRefWorker, "__init__"),
    "tool_loop": is_wrapped(ToolAgentLoop, "_handle_generating_state"), "sglang": sglang,
    "tool_loop_rr_attrs": [k for k, v in vars(ToolAgentLoop).items() if getattr(v, MARKER, None) is not None],
    "registry": {str(k): v.__name__ for k, v in EngineRegistry._engines["language_model"]["fsdp2"].items()},
    "rr_engine": [c.__name__ for c in _patches._ENGINES.values()],
    "hooks": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AfterImport"],
}))
"""

_RECORD = r"""
import logging
records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("rr_client").addHandler(_Keep())
"""


# verl's ActorRolloutRefWorker (role actor) built from verl's generated config, per case of CASES (ppo_config's
# arguments, ``rollout`` for enable_rollout_routing_replay): ["built", enable_routing_replay] or [error, message]
_WORKERS = r"""
import os as _os
from pathlib import Path as _Path
from tests.verl import harness as _h
_h.init_process()
from verl.workers.engine_workers import ActorRolloutRefWorker as _W
def _try(**kw):
    rollout = kw.pop("rollout", None)
    cfg = _h.ppo_config(_Path(_os.environ["RR_TEST_MODEL_DIR"]), **kw)
    if rollout is not None:
        cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay = rollout
    try:
        w = _W(config=cfg.actor_rollout_ref, role="actor")
    except Exception as e:
        return [type(e).__name__, " ".join(str(e).split())]
    return ["built", w.enable_routing_replay]
workers = {name: _try(**kw) for name, kw in CASES.items()}
"""


def with_workers(setup: str, **cases: dict[str, Any]) -> str:
    """``setup``, then verl's worker built for each case (reported under ``workers``)."""
    return setup + f"\nCASES = {cases!r}\n" + _WORKERS


def run_fresh(setup: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run ``setup`` then the report in a fresh interpreter (rr's records kept); (report, stderr)."""
    # the parent's process group (harness.init_process in an earlier test) holds MASTER_PORT: the child picks its own
    skip = ("RR_ALLOW_UNSUPPORTED_VERSION", "VERL_USE_EXTERNAL_PLUGINS", "MASTER_ADDR", "MASTER_PORT")
    e = {k: v for k, v in os.environ.items() if k not in skip}
    e.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", _RECORD + setup + _REPORT], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


_UNTESTED_VERL = r"""
import importlib.metadata
_real = importlib.metadata.version
importlib.metadata.version = lambda dist: "0.9.2" if dist == "verl" else _real(dist)
import verl  # rr's plugin runs here, from verl's entry-point loader
import rr_client.integrations.verl as _rr
_rr.install()  # re-entrant: still off, no second warning
"""


def test_untested_verl_is_left_unpatched_and_refuses_replay_in_the_worker(model_dir: Path) -> None:
    """verl 0.9.2 (faked in the metadata): one warning, nothing patched but the worker's guard; a worker asked for
    R2/R3 (or the rollout's routing) on FSDP raises naming why and the override; every other config is verl's."""
    got, err = run_fresh(
        with_workers(
            _UNTESTED_VERL,
            R3=dict(mode="R3"),
            R2=dict(mode="R2"),
            fsdp1_R3=dict(mode="R3", strategy="fsdp"),
            rollout_rows=dict(mode="disabled", rollout=True),
            disabled=dict(mode="disabled"),
        ),
        {"RR_TEST_MODEL_DIR": str(model_dir)},
    )
    assert got["plugin"] and not got["installed"] and got["guarded"] and not got["failed"]
    assert len(got["records"]) == 1, got["records"]
    level, msg = got["records"][0]
    assert level == "WARNING"
    for part in (
        "verl 0.9.2",
        "verl 0.9.1",
        "FSDP routing replay is off",
        "refuses to start",
        "RR_ALLOW_UNSUPPORTED_VERSION=1",
    ):
        assert part in msg, msg
    assert err.count("rr: verl 0.9.2") == 1  # what the user sees (verl's basic logging config), once
    assert got["worker"] and not got["tool_loop"] and got["sglang"] in (None, False)  # the guard only
    assert got["registry"] == {"cuda": "FSDPEngineWithLMHead", "npu": "FSDPEngineWithLMHead"} and not got["rr_engine"]
    w = got["workers"]
    assert w["disabled"] == ["built", False], w
    for case, asked in (
        ("R3", "router_replay.mode=R3"),
        ("R2", "router_replay.mode=R2"),
        ("fsdp1_R3", "router_replay.mode=R3"),
        ("rollout_rows", "enable_rollout_routing_replay=True"),
    ):
        kind, why = w[case]
        assert kind == "UnsupportedVersionError", (case, w[case])
        for part in (
            asked,
            "verl 0.9.2 is not a release rr was tested with",
            "train unreplayed",
            "RR_ALLOW_UNSUPPORTED_VERSION=1",
            "router_replay.mode=disabled",
        ):
            assert part in why, (case, part, why)


def test_the_override_patches_an_untested_verl(model_dir: Path) -> None:
    got, _ = run_fresh(
        with_workers(_UNTESTED_VERL, R3=dict(mode="R3")),
        {"RR_ALLOW_UNSUPPORTED_VERSION": "1", "RR_TEST_MODEL_DIR": str(model_dir)},
    )
    assert got["installed"] and not got["guarded"] and not got["records"] and not got["failed"]
    assert got["worker"] and got["tool_loop"] and got["sglang"] in (None, True)
    assert got["rr_engine"] == ["RRFSDPEngineWithLMHead"]
    assert got["workers"] == {"R3": ["built", True]}  # rr's replay, at the user's risk
    # registered by that worker (under this process's (device, vendor) key); verl's own entries as shipped
    assert got["registry"]["cuda"] == "FSDPEngineWithLMHead" and "RRFSDPEngineWithLMHead" in got["registry"].values()


def test_failed_patches_are_left_out_alone_and_refuse_replay_in_the_worker(model_dir: Path) -> None:
    """verl's ToolAgentLoop step renamed (imported before rr installs) and the FSDP engine reshaped: one error per
    patch naming it, those classes as verl ships them, the worker patch applied at its module's import. A worker
    asked for R3 raises naming both (multi-turn rows and the engine), R2 naming the engine; disabled is verl's."""
    got, err = run_fresh(
        with_workers(
            r"""
import verl  # VERL_USE_EXTERNAL_PLUGINS=none: rr not installed yet
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _T
_T._handle_generating_state_v2 = _T.__dict__["_handle_generating_state"]
del _T._handle_generating_state
import rr_client.integrations.verl as _rr
from rr_client.integrations.verl import _patches as _P
_P.ENGINE_SHAPES = {**_P.ENGINE_SHAPES, "initialize": ["self", "device"]}  # as if verl's engine changed
_rr.install()
_rr.install()  # a failed patch is not retried, nor logged again
import verl.workers.engine.fsdp.transformer_impl
""",
            R3=dict(mode="R3"),
            R2=dict(mode="R2"),
            disabled=dict(mode="disabled"),
        ),
        {"VERL_USE_EXTERNAL_PLUGINS": "none", "RR_TEST_MODEL_DIR": str(model_dir)},
    )
    assert got["installed"] and sorted(got["failed"]) == [
        "verl.experimental.agent_loop.tool_agent_loop",
        "verl.workers.engine.fsdp.transformer_impl",
    ]
    assert [r[0] for r in got["records"]] == ["ERROR", "ERROR"], got["records"]
    tool, engine = sorted((r[1] for r in got["records"]), key=lambda m: "patch_fsdp_engine" in m)
    assert "patch_tool_agent_loop" in tool and "ToolAgentLoop._handle_generating_state" in tool
    assert "is missing" in tool and "left as verl ships it" in tool and "refuses to start" in tool
    assert "patch_fsdp_engine" in engine and "does not have the shape rr relies on" in engine
    assert err.count("patch_tool_agent_loop") == 1
    assert not got["tool_loop"] and not got["tool_loop_rr_attrs"]
    assert got["worker"] and not got["rr_engine"]
    w = got["workers"]
    assert w["disabled"] == ["built", False], w
    assert w["R3"][0] == w["R2"][0] == "UnsupportedVersionError", w
    for part in (
        "router_replay.mode=R3",
        "rr's FSDP replay is not active",
        "patch_fsdp_engine",
        "patch_tool_agent_loop",
        "train unreplayed",
    ):
        assert part in w["R3"][1], (part, w["R3"][1])
    assert "patch_fsdp_engine" in w["R2"][1] and "patch_tool_agent_loop" not in w["R2"][1]  # R2 takes no rollout rows


def test_a_shape_change_inside_verls_import_is_contained(model_dir: Path) -> None:
    """``ActorRolloutRefWorker.__init__`` no longer has the shape rr wraps (as a new verl would): the import of
    ``verl.workers.engine_workers`` still works, one error names the patch; rr's guard takes its place, so a worker
    asked for R3 (or the rollout's rows) on FSDP raises naming the failed patch, and every other config is verl's."""
    got, _ = run_fresh(
        with_workers(
            r"""
from rr_client.integrations.verl import _patches as _P
_P.WORKER_INIT = ["self", "config", "role", "kwargs"]  # what rr expects no longer matches verl's signature
import verl
""",
            R3=dict(mode="R3"),
            rollout_rows=dict(mode="disabled", rollout=True),
            disabled=dict(mode="disabled"),
        ),
        {"RR_TEST_MODEL_DIR": str(model_dir)},
    )
    assert got["installed"] and list(got["failed"]) == ["verl.workers.engine_workers"]
    assert len(got["records"]) == 1 and got["records"][0][0] == "ERROR", got["records"]
    msg = got["records"][0][1]
    assert "patch_engine_workers" in msg and "does not have the shape rr relies on" in msg and "refuses to start" in msg
    assert got["worker"] and got["tool_loop"]  # the worker: rr's guard, not its patch
    w = got["workers"]
    assert w["disabled"] == ["built", False], w
    for case in ("R3", "rollout_rows"):
        kind, why = w[case]
        assert kind == "UnsupportedVersionError" and "patch_engine_workers" in why and "failed" in why, w[case]


def test_a_missing_verl_class_is_contained(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from rr_client.integrations.verl import _patches

    monkeypatch.setattr(_patches, "FAILED", {})
    assert not _patches.apply_patch("verl.experimental.agent_loop.tool_agent_loop", types.ModuleType("renamed"))
    errors = [r for r in caplog.records if r.name.startswith("rr_client")]
    assert len(errors) == 1 and "patch_tool_agent_loop" in errors[0].getMessage()
    assert "AttributeError" in errors[0].getMessage()


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_fsdp1_with_replay_is_refused(verl_process: None, model_dir: Path, mode: str) -> None:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = h.ppo_config(model_dir, mode=mode, strategy="fsdp")
    with pytest.raises(
        ConfigurationError, match=r"strategy=fsdp with .*mode=" + mode + r".*actor_rollout_ref\.actor\.strategy=fsdp2"
    ):
        ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    plain = h.ppo_config(model_dir, mode="disabled", strategy="fsdp")  # FSDP1 without replay: verl's, untouched
    assert ActorRolloutRefWorker(config=plain.actor_rollout_ref, role="actor").enable_routing_replay is False


def test_the_rollouts_rows_without_replay_are_refused_on_fsdp(verl_process: None, model_dir: Path) -> None:
    """``enable_rollout_routing_replay=True`` with ``router_replay.mode`` disabled on fsdp2: the rows would reach no
    replay (R3 silently off), so the worker refuses, naming the mode to set."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = h.ppo_config(model_dir, mode="disabled")
    cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    with pytest.raises(
        ConfigurationError,
        match=r"enable_rollout_routing_replay=True with actor\.strategy=fsdp2 but "
        r".*router_replay\.mode=disabled.*\+actor_rollout_ref\.actor\.fsdp_config\.router_replay\.mode=R3",
    ):
        ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")


def _loop(model_dir: Path, tokenizer: Any, server: ScriptedServer, strategy: str, mode: str) -> Any:
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    cfg = h.ppo_config(model_dir, mode=mode, strategy=strategy)
    cfg.actor_rollout_ref.rollout.response_length = 64
    return ToolAgentLoop(
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
    )


@pytest.mark.parametrize(
    "strategy,mode", [("megatron", "R3"), ("fsdp2", "disabled"), ("fsdp", "R3")], ids=["megatron", "disabled", "fsdp1"]
)
def test_tool_loop_is_verls_own_without_rrs_fsdp_replay(
    verl_process: None, model_dir: Path, tokenizer: Any, strategy: str, mode: str
) -> None:
    """Megatron's own R3 (its rows as verl keeps them: the last turn's), the disabled mode, FSDP1: verl's step."""
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from rr_client.core.patching import is_wrapped

    assert is_wrapped(ToolAgentLoop, "_handle_generating_state")
    prompt, out1, tool, out2 = [11, 12, 13, 14], [21, 22, 23], [31, 32], [41, 42]
    a, b = rows(len(prompt + out1) - 1, 1), rows(len(prompt + out1 + tool + out2) - 1, 2)
    server = ScriptedServer([(out1, a), (out2, b)])
    data = agent_data(prompt)
    run_turns(lambda: _loop(model_dir, tokenizer, server, strategy, mode), data, tool, 2)
    assert np.array_equal(np.asarray(data.routed_experts), b)  # verl's overwrite, rr did not act
    server_rr = ScriptedServer([(out1, a), (out2, b)])  # the same turns with rr's FSDP replay on: rows kept
    data_rr = agent_data(prompt)
    run_turns(lambda: _loop(model_dir, tokenizer, server_rr, "fsdp2", "R3"), data_rr, tool, 2)
    assert np.array_equal(np.asarray(data_rr.routed_experts), np.concatenate([a, b[len(a) :]]))


# -- SGLang's server read: needs SGLang importable (scripts/test_verl.sh's overlay run; deselected otherwise)


class TensorTokenizerManager:
    """Stand-in for SGLang's TokenizerManager before 0.5.11: ``meta_info.routed_experts`` is a tensor."""

    def __init__(self, tokens: list[int], routing: Any) -> None:
        self.tokens, self.routing = tokens, routing
        self.server_status = None

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        yield {
            "output_ids": list(self.tokens),
            "meta_info": {"routed_experts": self.routing, "finish_reason": {"type": "stop"}},
        }


@pytest.mark.sglang
@pytest.mark.parametrize("skip", [True, False], ids=["skip_tokenizer_init", "tokenizer"])
def test_sglang_read_is_verls_when_routing_replay_is_off(model_dir: Path, skip: bool) -> None:
    import asyncio

    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    from tests.verl.test_sglang_read import verl_server

    tm = TensorTokenizerManager([5, 6], "not routing: verl does not read it")
    s = verl_server(tm, model_dir, skip_tokenizer_init=skip)
    s.config.enable_rollout_routing_replay = False
    out = asyncio.run(SGLangHttpServer.generate(s, prompt_ids=[1, 2, 3], sampling_params={}, request_id="r"))
    assert out.routed_experts is None and s.tokenizer_manager is tm


@pytest.mark.sglang
def test_sglang_tensor_routing_stays_verls_read(model_dir: Path) -> None:
    """A payload verl reads itself (SGLang < 0.5.11's tensor) reaches verl unchanged, unchecked by rr: the server
    cannot tell Megatron's R3 from rr's (it sees no actor config), so rr takes only what verl's read crashes on."""
    import asyncio

    import torch
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    from tests.verl.test_sglang_read import verl_server

    routing = torch.arange(5 * 3 * 2, dtype=torch.int32).reshape(5, 3, 2)  # one row more than rr would accept
    tm = TensorTokenizerManager([5, 6], routing)
    s = verl_server(tm, model_dir, skip_tokenizer_init=True)
    out = asyncio.run(SGLangHttpServer.generate(s, prompt_ids=[1, 2, 3], sampling_params={}, request_id="r"))
    assert np.array_equal(out.routed_experts, routing.numpy())
    s.tokenizer_manager.server_status = "Up"  # verl's writes reach SGLang's manager through rr's wrapper
    assert tm.server_status == "Up"
