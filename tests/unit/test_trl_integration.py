"""rr_client.integrations.trl without an engine: version gate, refusals before TRL's own __init__ (no connection
attempted, or only ``/rr/info``), the TRL source rr's correction switch relies on, TRL's importance-sampling rule on
the engine's log-probs."""

from __future__ import annotations

import ast
import inspect
import math
import socket
import textwrap
from typing import Any

import pytest
import torch

from rr_client import ConfigurationError, GenerateResult, LogprobsModeError, RRError, UnsupportedVersionError
from rr_client.core.logprobs import parse_token_logprobs
from rr_client.integrations import trl as rr_trl
from tests.support.protocol_server import LogprobTestServer, ProtocolTestServer


def test_tested_trl_release_is_accepted_and_others_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RR_ALLOW_UNSUPPORTED_VERSION", raising=False)
    rr_trl.check_trl_version("1.16.0")
    rr_trl.check_trl_version("1.16.3")
    for other in ("1.17.0", "1.1.6", "0.16.0", "1.160.0"):
        with pytest.raises(UnsupportedVersionError, match=r"tested with trl 1\.16; found trl " + other):
            rr_trl.check_trl_version(other)
    monkeypatch.setenv("RR_ALLOW_UNSUPPORTED_VERSION", "1")
    rr_trl.check_trl_version("1.17.0")


def test_installed_trl_is_the_tested_one() -> None:
    import trl

    rr_trl.check_trl_version(trl.__version__)


def test_rollout_refuses_plain_grpo_trainer() -> None:
    rollout = rr_trl.RRRollout("http://127.0.0.1:9")  # nothing is sent before the trainer check
    try:
        with pytest.raises(ConfigurationError, match="only R3GRPOTrainer replays"):
            rollout(["a prompt"], object())
    finally:
        rollout.close()


@pytest.fixture()
def connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every TCP connect attempted in the test (none may be: refusals come before TRL reaches a server)."""
    seen: list[Any] = []
    real = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> Any:
        seen.append(address)
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return seen


def _trainer(**kw: Any) -> Any:
    from trl import GRPOConfig

    args = kw.pop("args", GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True))
    return rr_trl.R3GRPOTrainer(model=kw.pop("model", "unused"), reward_funcs=[], args=args, **kw)


def test_use_vllm_is_refused_before_trl_connects(connections: list[Any]) -> None:
    """Nothing listens on port 8000: TRL's own __init__ would try to connect for ~20 s; rr refuses first."""
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True, use_vllm=True, vllm_mode="server")
    rollout = rr_trl.RRRollout("http://127.0.0.1:8000")
    try:
        with pytest.raises(ConfigurationError, match="use_vllm=True") as e:
            _trainer(args=cfg, rollout_func=rollout)
    finally:
        rollout.close()
    assert isinstance(e.value, RRError) and connections == []


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tools": [lambda x: x]}, "tools"),
        ({"environment_factory": lambda: None}, "environment_factory"),
        ({"peft_config": object()}, "PEFT"),
    ],
)
def test_refusals_come_before_trls_init(kw: dict[str, Any], match: str, connections: list[Any]) -> None:
    rollout = rr_trl.RRRollout("http://127.0.0.1:9")
    try:
        with pytest.raises(ConfigurationError, match=match):
            _trainer(rollout_func=rollout, **kw)
    finally:
        rollout.close()
    assert connections == []


def test_trainer_refuses_a_rollout_that_is_not_rr() -> None:
    with pytest.raises(ConfigurationError, match=r"rollout_func=RRRollout"):
        _trainer(rollout_func=lambda prompts, trainer: {})


def test_sampling_params_follow_grpo_config() -> None:
    from trl import GRPOConfig

    cfg = GRPOConfig(
        output_dir="/tmp/rr-unused",
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        max_completion_length=12,
        repetition_penalty=1.1,
        generation_kwargs={"seed": 3},
        report_to=[],
        use_cpu=True,
    )
    sp = rr_trl.sampling_params_from(cfg, 4)
    assert sp == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "repetition_penalty": 1.1,
        "max_new_tokens": 12,
        "seed": 3,
    }


def test_rollout_carries_the_api_key_and_engines() -> None:
    from rr_client.integrations.weight_sync import WeightEngine

    eng = WeightEngine("http://10.0.0.2:8000", "vllm")
    rollout = rr_trl.RRRollout("http://127.0.0.1:9", engines=[eng], api_key="K")
    try:
        assert rollout.engines == [eng] and rollout.api_key == "K" and rollout.engine_urls == ["http://10.0.0.2:8000"]
    finally:
        rollout.close()
    with pytest.raises(ConfigurationError, match="not both"):
        rr_trl.RRRollout("http://127.0.0.1:9", engines=["a"], engine_urls=["b"])


# ----------------------------------------------------------------------------- importance sampling (TRL's rules)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.1, -4.0, -1.0]], dtype=torch.float64)
ENGINE = torch.tensor([[-1.5, -1.0, -0.5, float("nan")], [-0.2, -3.5, -1.0, -9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)


def _ratio(mode: str, lo: float | None = None, hi: float | None = 3.0) -> torch.Tensor:
    return rr_trl.importance_sampling_ratio(OLD, ENGINE, MASK, mode=mode, clip_min=lo, clip_max=hi)


def test_token_ratio_is_exp_of_trainer_minus_engine() -> None:
    r = _ratio("token_truncate", hi=None)
    expect = torch.exp(torch.nan_to_num((OLD - ENGINE) * MASK, nan=0.0))
    assert torch.allclose(r, expect)
    assert r[0, 0] == pytest.approx(math.exp(0.5)) and r[0, 3] == 1.0  # masked / NaN engine log-prob: ratio 1


def test_truncate_clamps_and_mask_zeroes_as_trl_does() -> None:
    raw = torch.exp(torch.nan_to_num((OLD - ENGINE) * MASK, nan=0.0))
    trunc = _ratio("token_truncate", lo=0.5, hi=3.0)
    assert torch.equal(trunc, raw.clamp(0.5, 3.0))
    masked = _ratio("token_mask", lo=0.5, hi=3.0)
    assert torch.equal(masked, torch.where((raw < 0.5) | (raw > 3.0), torch.zeros_like(raw), raw))
    assert masked[1, 1] == 0.0 and masked[1, 3] == 0.0 and masked[0, 0] == pytest.approx(math.exp(0.5))


def test_sequence_modes_use_the_summed_log_ratio() -> None:
    seq = torch.nan_to_num((OLD - ENGINE) * MASK, nan=0.0).sum(-1, keepdim=True)
    r = _ratio("sequence_truncate", hi=None)
    assert r.shape == (2, 1) and torch.allclose(r, torch.exp(seq))
    m = _ratio("sequence_mask", hi=3.0)
    assert m[0, 0] == pytest.approx(math.exp(seq[0, 0].item())) and m[1, 0] == 0.0  # exp(3.4) > 3: masked


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="vllm_importance_sampling_mode"):
        _ratio("tokens")


# ----------------------------------------------------------------------------- TRL's source, where rr switches it on
def _use_vllm_reads() -> dict[str, list[ast.AST]]:
    """Per GRPOTrainer method: the enclosing test (if/ternary/bool-op) of each ``self.use_vllm`` read."""
    from trl import GRPOTrainer

    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer)))
    reads: dict[str, list[ast.AST]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "use_vllm"
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                reads.setdefault(fn.name, []).append(parents.get(node, node))
    return reads


def _guards_correction(test: ast.AST) -> bool:
    """``self.use_vllm and self.vllm_importance_sampling_correction [and ...]``."""
    return (
        isinstance(test, ast.BoolOp)
        and isinstance(test.op, ast.And)
        and any(isinstance(v, ast.Attribute) and v.attr == "vllm_importance_sampling_correction" for v in test.values)
    )


def test_trl_reads_use_vllm_only_where_rr_switches_it() -> None:
    """R3GRPOTrainer._trl_correction sets ``use_vllm`` True around TRL's scoring and loss and False around its
    ``_generate``: in TRL 1.16 every read inside that window guards only the importance-sampling correction, and the
    loss multiplies the ratio in. A TRL that reads ``use_vllm`` anywhere else, or moves the multiplication, fails
    here before it could train with the correction silently off or its vLLM client called."""
    reads = _use_vllm_reads()
    assert set(reads) == {
        "__init__",
        "_generate_single_turn",
        "_tool_call_loop",
        "_generate",
        "_generate_and_score_completions",
        "_compute_loss",
    }, sorted(reads)
    for method in ("_generate_and_score_completions", "_compute_loss"):
        assert reads[method] and all(_guards_correction(t) for t in reads[method]), method
    from trl import GRPOTrainer

    loss_src = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss_src
    score_src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert 'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio' in score_src
    assert "self._generate(prompts)" in score_src  # rr's _generate switches use_vllm off around TRL's
    # rr's subclass overrides exactly the methods it switches in
    for name in ("_generate", "_generate_and_score_completions", "_compute_loss"):
        assert "_trl_correction" in inspect.getsource(getattr(rr_trl.R3GRPOTrainer, name)), name


def test_every_trl_method_rr_overrides_is_shape_checked() -> None:
    """Each GRPOTrainer method R3GRPOTrainer overrides is in the shape check run as it is defined, and the installed
    TRL passes it."""
    from trl import GRPOTrainer

    from rr_client.integrations.trl._trainer import OVERRIDDEN, check_trl_shapes

    overridden = {
        name for name, value in vars(rr_trl.R3GRPOTrainer).items() if callable(value) and hasattr(GRPOTrainer, name)
    }
    assert overridden == set(OVERRIDDEN), sorted(overridden ^ set(OVERRIDDEN))
    check_trl_shapes(GRPOTrainer)


def test_a_trl_that_moved_an_overridden_method_is_refused() -> None:
    """A GRPOTrainer without ``_generate`` and with another ``training_step``: one UnsupportedVersionError naming
    both, the parameters rr passes, and the installed TRL against the tested one."""
    import trl

    from rr_client.integrations.trl._trainer import OVERRIDDEN, check_trl_shapes

    def training_step(self: Any, model: Any, inputs: Any) -> None:  # num_items_in_batch gone
        return None

    methods = {name: getattr(trl.GRPOTrainer, name) for name in OVERRIDDEN if name != "_generate"}
    moved = type("GRPOTrainer", (), {**methods, "training_step": training_step})
    with pytest.raises(UnsupportedVersionError) as exc:
        check_trl_shapes(moved)
    msg = str(exc.value)
    assert "GRPOTrainer._generate is missing" in msg, msg
    assert (
        "GRPOTrainer.training_step(self, model, inputs) does not have the shape rr relies on "
        "(self, model, inputs, num_items_in_batch)"
    ) in msg, msg
    assert f"in TRL {trl.__version__} (rr was tested with TRL 1.16)" in msg, msg


def test_a_missing_engine_logprob_is_nan() -> None:
    """An engine log-prob of None reaches TRL as NaN (TRL's ratio is 1 there), read from GenerateResult.logprobs."""
    r = GenerateResult(
        index=0,
        prompt_index=0,
        prompt_ids=[1],
        output_ids=[5, 6],
        text=None,
        finish_reason=None,
        routed_experts=None,
        routed_experts_start=0,
        meta={},
        logprobs=parse_token_logprobs([[-0.5, 5], [None, 6]], [5, 6], where="t"),
    )
    got = rr_trl.sampled_logprobs(r)
    assert got[0] == -0.5 and math.isnan(got[1])
    with pytest.raises(RRError, match="no log-probs"):
        rr_trl.sampled_logprobs(
            GenerateResult(
                index=0,
                prompt_index=0,
                prompt_ids=[1],
                output_ids=[5],
                text=None,
                finish_reason=None,
                routed_experts=None,
                routed_experts_start=0,
                meta={},
            )
        )


@pytest.mark.parametrize("mode", ["raw", None])
def test_pre_temperature_logprobs_are_refused_after_one_info_call(mode: str | None) -> None:
    """A server whose log-probs are before temperature (or of unknown mode), GRPO at temperature 0.7: refused
    after /rr/info, before TRL's __init__ and before any generation."""
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True, temperature=0.7)
    with ProtocolTestServer() as server:
        if mode is not None:
            server.behaviour.identity = {"logprobs_mode": mode}
        rollout = rr_trl.RRRollout(server.url)
        try:
            with pytest.raises(LogprobsModeError, match="processed_logprobs") as e:
                _trainer(args=cfg, rollout_func=rollout)
        finally:
            rollout.close()
        assert "temperature 0.7" in str(e.value) and "R3GRPOTrainer" in str(e.value)
        assert server.behaviour.info_calls == 1 and server.behaviour.calls == 0


class _ReachedTRL(Exception):
    """Raised in place of TRL's own ``GRPOTrainer.__init__``: rr's checks before it all passed."""


@pytest.mark.parametrize(
    "config, rollout_kw, named",
    [
        ({"top_p": 0.9}, {}, "top_p=0.9"),  # issue 44: temperature 1, top_p 0.9
        ({"top_k": 20}, {}, "top_k=20"),
        ({"min_p": 0.05}, {}, "min_p=0.05"),
        ({"repetition_penalty": 1.1}, {}, "repetition_penalty=1.1"),
        ({"generation_kwargs": {"presence_penalty": 0.5}}, {}, "presence_penalty=0.5"),
        ({}, {"sampling_params": {"frequency_penalty": 0.2}}, "frequency_penalty=0.2"),
    ],
    ids=["top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "rollout_sampling_params"],
)
def test_raw_logprobs_sampled_with_a_filter_are_refused_at_temperature_1(
    config: dict[str, Any], rollout_kw: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw (or unknown-mode) log-probs of a rollout sampled at temperature 1 with a filter or penalty on (from
    GRPOConfig, its generation_kwargs or RRRollout's params) are the untruncated distribution's: refused after
    /rr/info, naming the flag; the same rollout on a processed server passes rr's checks and reaches TRL."""
    from trl import GRPOConfig, GRPOTrainer

    def reached(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _ReachedTRL

    monkeypatch.setattr(GRPOTrainer, "__init__", reached)
    cfg = GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True, temperature=1.0, **config)
    for mode in ("raw", None, "processed"):
        with ProtocolTestServer() as server:
            if mode is not None:
                server.behaviour.identity = {"logprobs_mode": mode}
            rollout = rr_trl.RRRollout(server.url, **rollout_kw)
            try:
                if mode == "processed":
                    with pytest.raises(_ReachedTRL):
                        _trainer(args=cfg, rollout_func=rollout)
                    continue
                with pytest.raises(LogprobsModeError, match="processed_logprobs") as e:
                    _trainer(args=cfg, rollout_func=rollout)
            finally:
                rollout.close()
            assert named in str(e.value) and "R3GRPOTrainer" in str(e.value)
            assert server.behaviour.info_calls == 1 and server.behaviour.calls == 0


def test_raw_logprobs_with_grpos_default_sampling_reach_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPOConfig's defaults (temperature 1, top_p 1, top_k 0, no min_p, no penalty) filter nothing: raw
    log-probs pass rr's checks; one more filter in the rollout's params and they are refused."""
    from trl import GRPOConfig, GRPOTrainer

    def reached(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _ReachedTRL

    monkeypatch.setattr(GRPOTrainer, "__init__", reached)
    cfg = GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True)
    with ProtocolTestServer() as server:
        server.behaviour.identity = {"logprobs_mode": "raw"}
        for extra, outcome in (({}, _ReachedTRL), ({"top_p": 0.95}, LogprobsModeError)):
            rollout = rr_trl.RRRollout(server.url, sampling_params=extra)
            try:
                with pytest.raises(outcome):
                    _trainer(args=cfg, rollout_func=rollout)
            finally:
                rollout.close()


@pytest.mark.parametrize(
    "config, rollout_kw, match",
    [
        (
            {"temperature": 0.7},
            {"sampling_params": {"temperature": 1.0}},
            "temperature 1.0 but GRPOConfig.temperature is 0.7",
        ),
        ({"loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"}, {}, "vespo"),
    ],
    ids=["a_rollout_temperature_other_than_the_trainers", "vespo_with_a_sequence_correction_as_trl_does"],
)
def test_a_grpo_config_the_rollout_cannot_serve_is_refused(
    config: dict[str, Any], rollout_kw: dict[str, Any], match: str, connections: list[Any]
) -> None:
    from trl import GRPOConfig

    cfg = GRPOConfig(output_dir="/tmp/rr-unused", report_to=[], use_cpu=True, **config)
    rollout = rr_trl.RRRollout("http://127.0.0.1:9", **rollout_kw)
    try:
        with pytest.raises(ConfigurationError, match=match):
            _trainer(args=cfg, rollout_func=rollout)
    finally:
        rollout.close()
    assert connections == []


class _StaleEveryFourth(LogprobTestServer):
    """TEST-ONLY: :class:`LogprobTestServer`, except every fourth sample it makes, which says it was recomputed across a
    weight update (``rr_provenance``) and whose log-probs are -60.0 (a gap of ~55 nats: a stale sample's log-probs
    are another policy's)."""

    made = 0

    def _sample(self, prompt: list[int], j: int, params: dict[str, Any], want: bool, start: int) -> dict[str, Any]:
        from rr_client.core.provenance import Provenance

        out = super()._sample(prompt, j, params, want, start)
        stale = type(self).made % 4 == 0
        type(self).made += 1
        if stale:
            out["meta_info"]["output_token_logprobs"] = [[-60.0, t, None] for t in out["output_ids"]]
            prov = Provenance(preemptions=1, weight_version_admitted=1, weight_version_finished=2)
            out["meta_info"]["rr_provenance"] = prov.to_dict()
        return out


def _train_masked(tmp_path: Any, server: ProtocolTestServer, *, max_steps: int, **rollout_options: Any) -> Any:
    """TRL 1.16's real ``R3GRPOTrainer.train`` on the tiny Qwen3-MoE with ``stale_rows="mask"`` against ``server``
    (``RRRollout(server.url, **rollout_options)``), batches of 4 samples of 4 tokens, auditing every step; the
    trained trainer."""
    import transformers
    from datasets import Dataset

    from rr_client.integrations.trl import R3GRPOTrainer, RRRollout
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.grpo import cpu_grpo_config
    from tests.support.vllm_process import CACHE

    model_dir = build_tiny_moe(
        CACHE / "qwen3_dense", arch="qwen3_moe", num_layers=3, num_experts=8, topk=2, mlp_only_layers=(1,)
    )
    cfg = cpu_grpo_config(
        str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=max_steps,
        learning_rate=1e-3,
        vllm_importance_sampling_correction=False,  # the server's log-probs are made up
    )
    rollout = RRRollout(server.url, **rollout_options)
    try:
        trainer = R3GRPOTrainer(
            model=transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            args=cfg,
            processing_class=transformers.AutoTokenizer.from_pretrained(model_dir),
            train_dataset=Dataset.from_dict({"prompt": ["the quick brown fox", "hello world and"] * 4}),
            rollout_func=rollout,
            sync_weights=False,
            audit_every=1,
            stale_rows="mask",
        )
        trainer.train()
    finally:
        rollout.close()
    return trainer


def test_trl_masked_samples_are_out_of_the_gap(tmp_path: Any) -> None:
    """TRL 1.16's real ``GRPOTrainer.train`` with ``stale_rows="mask"`` (issue 56, item 2): the one stale sample of
    each batch of 4 reaches the session's door with its provenance (no rollout-time masking in the adapter), is left
    to the router, counted under ``r3/stale_masked``, and is out of ``r3/mean_abs_logp_diff`` / ``r3/k3_kl``: the
    step's gap is measured on the other 3 samples' tokens only, so its -60 log-probs move neither."""
    from rr_client.trainer import keys as K

    _StaleEveryFourth.made = 0
    with _StaleEveryFourth(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as server:
        trainer = _train_masked(tmp_path, server, max_steps=2)
    logs = [h for h in trainer.state.log_history if K.LOGP_TOKENS in h]
    assert len(logs) == 2, trainer.state.log_history
    for log in logs:
        assert log[K.STALE_MASKED] == 1.0, log  # counted once per step, by the session's door
        assert log[K.LOGP_TOKENS] == 3 * 4, log  # the 3 replayed samples' completion tokens only
        # the trainer's log-probs of a tiny random model are ~-log(vocab) away from -1.0; the stale sample's
        # -60.0 would put the mean past 15 and k3 past 1e20
        assert log[K.MEAN_ABS_LOGP_DIFF] < 10 and log[K.K3_KL] < 1e3, log


def test_trl_samples_the_source_audit_flags_are_masked(tmp_path: Any) -> None:
    """TRL 1.16's real ``GRPOTrainer.train`` with ``RRRollout(url, source_audit=1.0)`` (issue 57): the rollout's
    client re-scores every sample; the server (TEST-ONLY protocol stand-in, ``late_decode``) answers every other
    sample with generated rows of other tokens, which its re-score does not give back: those samples are flagged in
    their provenance, reach the session's door, are masked by ``stale_rows="mask"`` and counted under
    ``r3/source/flagged``, ``r3/stale_masked`` and the per-segment ``r3/source/generated/agreement``."""
    from rr_client.trainer import keys as K

    with LogprobTestServer(layers=3, topk=2, num_experts=8, moe_layers=[0, 2]) as server:
        server.behaviour.corrupt = "late_decode"
        trainer = _train_masked(tmp_path, server, max_steps=1, source_audit=1.0)
        salted = [b for b in server.behaviour.bodies if b.get("cache_salt")]
    logs = [h for h in trainer.state.log_history if K.SOURCE_CHECKED in h]
    assert len(logs) == 1, trainer.state.log_history
    (log,) = logs
    assert log[K.SOURCE_CHECKED] == 4 and log[K.SOURCE_FLAGGED] == 2 == log[K.STALE_MASKED], log
    assert log[K.source("agreement", "generated")] < 0.9 and log[K.source("agreement", "computed_prompt")] == 1.0
    assert len(salted) == 4 and all(b["sampling_params"]["max_new_tokens"] == 1 for b in salted)
