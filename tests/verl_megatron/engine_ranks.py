"""verl's own Megatron engine on two gloo ranks (PP = 2, CP = 2): the rank-side cases of test_engine_parallel.py
(module-level functions, run by tests/megatron/launcher.py's spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


def _worker(rank: int, *, pp: int = 1, cp: int = 1, mode: str = "R3") -> tuple[Any, Any]:
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.support.vllm_process import CACHE
    from tests.verl import harness as vh
    from tests.verl_megatron import harness as h
    from tests.verl_megatron.conftest import MODEL_SPEC

    for k, v in (("RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", 2)):
        os.environ[k] = str(v)
    vh.init_process()  # the launcher's 2-rank group is up: only verl's CPU platform here
    h.install_stand_ins()
    # megatron's p2p shape exchange (variable_seq_lengths) syncs the CUDA stream around its gloo send/recv
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    model_dir = build_tiny_moe(CACHE / "verl-mcore-qwen3", **MODEL_SPEC)
    cfg = h.ppo_config(model_dir, mode=mode)
    m = cfg.actor_rollout_ref.actor.megatron
    m.pipeline_model_parallel_size, m.context_parallel_size = pp, cp
    m.override_transformer_config["batch_p2p_comm"] = False  # gloo has no batched P2P
    w = vh.actor_worker(cfg)
    return cfg, w


def trainer_batch(batch: Any) -> Any:
    """The TensorDict ``RayPPOTrainer._compute_old_log_prob`` hands ``compute_log_prob`` (its steps 1-3, verl's own
    functions); Ray's dispatch, which calls the worker on every rank and keeps the last stage's output, is the
    test's: each rank calls the worker itself."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
    return td


def case_pp2(rank: int) -> dict[str, Any]:
    cfg, w = _worker(rank, pp=2)
    w.actor.engine.tf_config.variable_seq_lengths = True  # verl's p2p sends shapes first (its schedule's seq_length=1)
    return _log_prob(cfg, w, seed=31)


def case_cp2(rank: int) -> dict[str, Any]:
    cfg, w = _worker(rank, cp=2)
    return _log_prob(cfg, w, seed=32)


def _log_prob(cfg: Any, w: Any, *, seed: int) -> dict[str, Any]:
    import transformers

    from tests.verl_megatron import harness as h
    from tests.verl_megatron.test_engine_replay import batch_of, random_rows, sample_tokens

    engine = w.actor.engine
    tok = transformers.AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    toks = sample_tokens(seed)
    rows = [random_rows(len(p) + len(r) - 1, seed=10 * seed + i) for i, (p, r) in enumerate(toks)]
    seen = h.MoeSeen(engine.module[0])
    try:
        out = w.compute_log_prob(trainer_batch(batch_of(tok, toks, rows)))
    finally:
        seen.remove()
    return {
        "layers": sorted(seen.maps),
        "maps": {k: [m.numpy() for m in v] for k, v in seen.maps.items()},
        "rows": [np.asarray(r) for r in rows],
        "lengths": [len(p) + len(r) for p, r in toks],
        "metrics": dict(getattr(engine, "rr_last_metrics", {})),
        "log_probs": None if out is None else out["log_probs"].to_padded_tensor(0.0).float().numpy(),
    }
