"""rr in verl, gated and contained: an untested verl is left unpatched, a patch that no longer fits is left out
alone, FSDP1 with replay is refused, and the multi-turn and SGLang patches leave every other setting to verl.

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

from rr_client.errors import ConfigurationError
from tests.verl import harness as h
from tests.verl.test_multi_turn import ScriptedServer, agent_data, rows, run_turns

ROOT = Path(__file__).resolve().parents[2]

# verl's four targets as seen in a fresh process, printed as one JSON line (stdout's last)
_REPORT = r'''
import json, sys
import verl.workers.engine_workers, verl.experimental.agent_loop.tool_agent_loop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine_workers import ActorRolloutRefWorker
import rr_client.integrations.verl as rr
from rr_client.integrations.verl import _patches
from rr_client.patching import MARKER, is_wrapped
try:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer
    sglang = is_wrapped(SGLangHttpServer, "generate")
except ImportError:  # no SGLang in this env: verl's server module does not import
    sglang = None
print(json.dumps({
    "records": records, "plugin": "rr_client.integrations.verl._plugin" in sys.modules,
    "installed": rr.installed(), "failed": rr.failed_patches(),
    "worker": is_wrapped(ActorRolloutRefWorker, "__init__"),
    "tool_loop": is_wrapped(ToolAgentLoop, "_handle_generating_state"), "sglang": sglang,
    "tool_loop_rr_attrs": [k for k, v in vars(ToolAgentLoop).items() if getattr(v, MARKER, None) is not None],
    "registry": {str(k): v.__name__ for k, v in EngineRegistry._engines["language_model"]["fsdp2"].items()},
    "rr_engine": [c.__name__ for c in _patches._ENGINES.values()],
    "hooks": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AfterImport"],
}))
'''

_RECORD = r'''
import logging
records = []
class _Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("rr_client").addHandler(_Keep())
'''


def run_fresh(setup: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run ``setup`` then the report in a fresh interpreter (rr's records kept); (report, stderr)."""
    e = {k: v for k, v in os.environ.items() if k not in ("RR_ALLOW_UNSUPPORTED_VERSION", "VERL_USE_EXTERNAL_PLUGINS")}
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-c", _RECORD + setup + _REPORT], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


_OLD_VERL = r'''
import importlib.metadata
_real = importlib.metadata.version
importlib.metadata.version = lambda dist: "0.8.0" if dist == "verl" else _real(dist)
import verl  # rr's plugin runs here, from verl's entry-point loader
import rr_client.integrations.verl as _rr
_rr.install()  # re-entrant: still off, no second warning
'''


def test_untested_verl_is_left_unpatched_with_one_warning() -> None:
    got, err = run_fresh(_OLD_VERL)
    assert got["plugin"] and not got["installed"] and not got["hooks"] and not got["failed"]
    assert len(got["records"]) == 1, got["records"]
    level, msg = got["records"][0]
    assert level == "WARNING"
    for part in ("verl 0.8.0", "verl 0.9.1", "FSDP routing replay is off", "RR_ALLOW_UNSUPPORTED_VERSION=1"):
        assert part in msg, msg
    assert err.count("rr: verl 0.8.0") == 1  # what the user sees (verl's basic logging config), once
    assert not got["worker"] and not got["tool_loop"] and got["sglang"] in (None, False)
    assert got["registry"] == {"cuda": "FSDPEngineWithLMHead", "npu": "FSDPEngineWithLMHead"} and not got["rr_engine"]


def test_the_override_patches_an_untested_verl() -> None:
    got, _ = run_fresh(_OLD_VERL, {"RR_ALLOW_UNSUPPORTED_VERSION": "1"})
    assert got["installed"] and not got["records"] and not got["failed"]
    assert got["worker"] and got["tool_loop"] and got["sglang"] in (None, True)
    assert got["rr_engine"] == ["RRFSDPEngineWithLMHead"]
    # registered only where a worker turns replay on: verl's registry as it ships until then
    assert got["registry"] == {"cuda": "FSDPEngineWithLMHead", "npu": "FSDPEngineWithLMHead"}


def test_a_renamed_verl_method_leaves_only_its_patch_out() -> None:
    """verl's ToolAgentLoop step renamed (imported before rr installs): one error naming the patch, the loop as
    verl ships it, the other patches applied at their modules' import."""
    got, err = run_fresh(r'''
import verl  # VERL_USE_EXTERNAL_PLUGINS=none: rr not installed yet
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _T
_T._handle_generating_state_v2 = _T.__dict__["_handle_generating_state"]
del _T._handle_generating_state
import rr_client.integrations.verl as _rr
_rr.install()
_rr.install()  # a failed patch is not retried, nor logged again
import verl.workers.engine.fsdp.transformer_impl
''', {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert got["installed"] and list(got["failed"]) == ["verl.experimental.agent_loop.tool_agent_loop"]
    assert len(got["records"]) == 1, got["records"]
    level, msg = got["records"][0]
    assert level == "ERROR" and "patch_tool_agent_loop" in msg and "ToolAgentLoop._handle_generating_state" in msg
    assert "is missing" in msg and "left as verl ships it" in msg
    assert err.count("patch_tool_agent_loop") == 1
    assert not got["tool_loop"] and not got["tool_loop_rr_attrs"]
    assert got["worker"] and got["rr_engine"] == ["RRFSDPEngineWithLMHead"]


def test_a_shape_change_inside_verls_import_is_contained() -> None:
    """``ActorRolloutRefWorker.__init__`` no longer has the shape rr wraps (as a new verl would): the import of
    ``verl.workers.engine_workers`` still works, one error names the patch, the worker is verl's own."""
    got, _ = run_fresh(r'''
from rr_client.integrations.verl import _patches as _P
_P.WORKER_INIT = ["self", "config", "role", "kwargs"]  # what rr expects no longer matches verl's signature
import verl
''')
    assert got["installed"] and list(got["failed"]) == ["verl.workers.engine_workers"]
    assert len(got["records"]) == 1 and got["records"][0][0] == "ERROR", got["records"]
    msg = got["records"][0][1]
    assert "patch_engine_workers" in msg and "does not have the shape rr wraps" in msg and "will not replay" in msg
    assert not got["worker"] and got["tool_loop"]


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
    with pytest.raises(ConfigurationError, match=r"strategy=fsdp with .*mode=" + mode
                       + r".*actor_rollout_ref\.actor\.strategy=fsdp2"):
        ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    plain = h.ppo_config(model_dir, mode="disabled", strategy="fsdp")  # FSDP1 without replay: verl's, untouched
    assert ActorRolloutRefWorker(config=plain.actor_rollout_ref, role="actor").enable_routing_replay is False


def _loop(model_dir: Path, tokenizer: Any, server: ScriptedServer, strategy: str, mode: str) -> Any:
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    cfg = h.ppo_config(model_dir, mode=mode, strategy=strategy)
    cfg.actor_rollout_ref.rollout.response_length = 64
    return ToolAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                         processor=None, dataset_cls=None, data_config=DictConfigWrap(cfg.data))


@pytest.mark.parametrize("strategy,mode", [("megatron", "R3"), ("fsdp2", "disabled"), ("fsdp", "R3")],
                         ids=["megatron", "disabled", "fsdp1"])
def test_tool_loop_is_verls_own_without_rrs_fsdp_replay(verl_process: None, model_dir: Path, tokenizer: Any,
                                                        strategy: str, mode: str) -> None:
    """Megatron's own R3 (its rows as verl keeps them: the last turn's), the disabled mode, FSDP1: verl's step."""
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from rr_client.patching import is_wrapped

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
    assert np.array_equal(np.asarray(data_rr.routed_experts), np.concatenate([a, b[len(a):]]))


# -- SGLang's server read: needs SGLang importable (scripts/test_verl.sh's overlay run; deselected otherwise)

class TensorTokenizerManager:
    """Stand-in for SGLang's TokenizerManager before 0.5.11: ``meta_info.routed_experts`` is a tensor."""

    def __init__(self, tokens: list[int], routing: Any) -> None:
        self.tokens, self.routing = tokens, routing
        self.server_status = None

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        yield {"output_ids": list(self.tokens), "meta_info": {"routed_experts": self.routing,
                                                              "finish_reason": {"type": "stop"}}}


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
