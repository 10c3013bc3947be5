"""verl's own code, driven in one CPU process: the actor worker, the agent loop's layout, the trainer's data steps.

- :func:`actor_worker` builds verl's ``ActorRolloutRefWorker`` (role ``actor``) from verl's generated PPO config,
  so the engine comes from verl's registry (rr's plugin put its FSDP engine there) and ``compute_log_prob`` /
  ``update_actor`` run with verl's routing-replay flag decorator.
- :func:`agent_loop_batch` lays samples out with ``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``
  (verl's left-padded prompt, right-padded response, ``routed_experts`` from the first real prompt token).
- :func:`compute_log_prob` / :func:`update_actor` are ``RayPPOTrainer._compute_old_log_prob`` / ``_update_actor``
  with the worker in place of the Ray worker group.

Stand-ins, named: the accelerator (tests/verl/cpu_platform.py), a single-process gloo group instead of Ray's, and
the Ray worker group (the worker is called in process). The model, data path, engine and replay are real.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.verl import cpu_platform

PROMPT_LEN, RESPONSE_LEN = 12, 8


def init_process() -> None:
    """One-rank gloo process group + the CPU platform; verl's engine registry is read for device ``cuda``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    # verl registers its FSDP engine for cuda/npu only; the CPU platform picks it through verl's own override
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cpu_platform.install()


def ppo_config(
    model_dir: Path,
    *,
    mode: str = "R3",
    remove_padding: bool = True,
    strategy: str = "fsdp2",
    micro_batch: int = 2,
    mini_batch: int = 4,
    lr: float = 1e-2,
    dynamic_bsz: bool = False,
) -> Any:
    """verl's generated PPO trainer config, for a tiny fp32 run on this machine."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    a = cfg.actor_rollout_ref
    a.model.path = str(model_dir)
    a.model.use_remove_padding = remove_padding
    a.model.override_config = {"attn_implementation": "sdpa"}  # flash-attn is CUDA only
    a.actor.strategy = strategy
    f = a.actor.fsdp_config
    f.use_torch_compile, f.model_dtype = False, "fp32"
    f.mixed_precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    a.actor.use_torch_compile = False
    a.actor.optim.lr = lr
    a.actor.optim.weight_decay = 0.0  # router weights move only through their gradient
    a.actor.ppo_mini_batch_size, a.actor.ppo_micro_batch_size_per_gpu = mini_batch, micro_batch
    a.actor.ppo_epochs = 1
    a.actor.shuffle = False
    a.rollout.log_prob_micro_batch_size_per_gpu = micro_batch
    a.rollout.n = 1
    if dynamic_bsz:  # micro-batches by a token budget: verl regroups (and reorders) the samples
        a.actor.use_dynamic_bsz = a.rollout.log_prob_use_dynamic_bsz = True
        a.actor.ppo_max_token_len_per_gpu = a.rollout.log_prob_max_token_len_per_gpu = 24
    a.rollout.prompt_length, a.rollout.response_length = PROMPT_LEN, RESPONSE_LEN
    a.rollout.name = "vllm"  # the rollout these tests' rows and log-probs come from (verl's yaml leaves it "???")
    a.rollout.enable_rollout_routing_replay = mode == "R3"
    OmegaConf.set_struct(f, False)
    f.router_replay = {"mode": mode}  # the key verl reads for megatron/veomni (`+...fsdp_config.router_replay.mode=R3`)
    return cfg


def actor_worker(cfg: Any) -> Any:
    """verl's ``ActorRolloutRefWorker`` with role ``actor``, model built."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    w = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    w.init_model()
    return w


def trainer(cfg: Any, worker: Any) -> Any:
    """verl's ``RayPPOTrainer`` with only what its data steps read: the config and the worker (as the group)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    t = object.__new__(RayPPOTrainer)
    t.config = cfg
    t.actor_rollout_wg = worker
    t.distillation_config = None
    return t


def agent_loop_batch(tokenizer: Any, samples: Sequence[dict[str, Any]]) -> Any:
    """verl's agent-loop layout of ``samples`` (``prompt_ids``, ``response_ids``, optional ``response_mask``,
    ``routed_experts`` ``[rows, L, K]``, ``response_logprobs``, ``extra_fields``: the rollout server's per-sample
    fields, e.g. vLLM's ``num_cached_tokens``) as the ``DataProto`` its trainer receives."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker

    w = object.__new__(AgentLoopWorker)
    w.tokenizer, w.processor = tokenizer, None
    w.rollout_config = SimpleNamespace(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)
    w.reward_loop_worker_handles = None
    w.distillation_enabled = False
    w.mm_processor_kwargs = None

    async def run() -> list[Any]:
        outs = []
        for s in samples:
            out = AgentLoopOutput(
                prompt_ids=list(s["prompt_ids"]),
                response_ids=list(s["response_ids"]),
                response_mask=list(s.get("response_mask") or [1] * len(s["response_ids"])),
                response_logprobs=s.get("response_logprobs"),
                routed_experts=s.get("routed_experts"),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields=dict(s.get("extra_fields") or {}),  # what verl's rollout server returned per sample
            )
            outs.append(await w._agent_loop_postprocess(out, False, raw_prompt=""))
        return outs

    batch = w._postprocess(asyncio.run(run()))
    # what RayPPOTrainer.fit sets before its steps
    batch.meta_info["temperature"] = 1.0
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(dim=-1).tolist()
    batch.batch["advantages"] = (
        torch.linspace(-1.0, 1.0, len(samples))[:, None].expand_as(batch.batch["response_mask"]).float()
        * batch.batch["response_mask"]
    )
    return batch


def compute_log_prob(t: Any, batch: Any) -> tuple[Any, Any]:
    """The trainer's old-log-prob step; returns (old_log_prob DataProto, the worker's raw log_probs output)."""
    old, _mfu = t._compute_old_log_prob(batch)
    return old


def update_actor(t: Any, batch: Any) -> dict[str, Any]:
    """The trainer's actor update; returns its metrics (``actor/...``)."""
    out = t._update_actor(batch)
    return out.meta_info["metrics"]


def own_routing(model: Any, tokens: Sequence[int]) -> np.ndarray:
    """transformers' own top-k of one unpadded sequence, ``[len - 1, L, K]`` like an engine returns."""
    from rr_client.trainer.replay import record_routing

    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=torch.tensor([list(tokens)]))
    return rec.routed_experts[0, :-1].numpy()
