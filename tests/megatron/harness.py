"""Megatron-core's own ``GPTModel`` and ``TopKRouter`` on this CPU, for rr's Megatron replay tests.

- :func:`init_parallel` starts a gloo process group (one process, or a rank of :mod:`tests.megatron.launcher`) and
  Megatron's ``parallel_state`` with the TP / PP / CP sizes asked for, after :func:`patch_cpu`.
- :func:`build_gpt` builds ``GPTModel`` from the local (non-Transformer-Engine) spec: dense and MoE layers
  (``moe_layer_freq``), local ``SequentialMLP`` experts, the allgather dispatcher, optional MTP and full recompute,
  with ``moe_enable_routing_replay`` on; :func:`new_model_state` first clears the process-global state one model
  leaves behind.
- :class:`RouterChoices` records what every ``TopKRouter`` chose, from a forward hook on the router's own output
  (its ``routing_map``): independent of rr's feeder and of Megatron's ``RouterReplay`` bookkeeping.

Test-side patches, named as such (what cannot run on a CPU as shipped; none of them touches routing or replay):
``torch.cuda.current_device`` -> ``"cpu"``; Megatron's CUDA RNG get/set pointed at the CPU RNG, with CPU states
registered in its RNG tracker (recompute and dropout fork it); ``moe_utils.te_general_gemm = None`` (0.16.1 reaches
for Transformer Engine's GEMM when it imports); an explicit causal mask (:func:`causal_mask`), since the local
attention has no implicit one; the schedules' token counter (``torch.zeros(device="cuda")``) on the CPU. Megatron's
local attention has no context parallelism: with CP > 1 the model's config says CP = 2 but its attention modules are
built with a copy saying 1, so each rank attends within its own slice (a stand-in for the attention only; the batch
is sliced by Megatron's own ``get_batch_on_this_cp_rank`` and the routers see exactly the CP-local tokens). Under
sequence parallel the norms are torch's own LayerNorm, built as without SP (Megatron's local norm refuses SP; Apex's
is not installed): the forward is the same, their grads are not summed over TP ranks.
"""

from __future__ import annotations

import copy
import os
import socket
import types
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

VOCAB = 64
HIDDEN = 16
HEADS = 2
MAX_SEQ = 64
TIMEOUT_MINUTES = 3  # gloo's wait in a collective a peer rank never reaches (a deadlock guard, not an assertion)

_SAVED: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) of every test-side patch, in patch order


_MISSING = object()  # an attribute the patch creates (0.16.1 without Transformer Engine has no te_general_gemm)


def _patch(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name`` to ``value``, keeping the original (raw, from a class's own dict) for :func:`unpatch_cpu`."""
    original = vars(owner).get(name, _MISSING)
    _SAVED.append((owner, name, original))
    setattr(owner, name, value)


def patch_cpu() -> None:
    """Apply the CPU test-side patches (idempotent): CUDA device and RNG to the CPU, no Transformer Engine GEMM."""
    if _SAVED:
        return
    # test-side patch: tensors Megatron puts on "the GPU" go to the CPU
    _patch(torch.cuda, "current_device", lambda: "cpu")
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # test-side patch: Megatron's CUDA RNG state is the CPU RNG's (recompute restores it, dropout forks it)
    _patch(mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _patch(mrandom, "_set_cuda_rng_state", lambda new_state, *args, **kwargs: torch.set_rng_state(new_state))
    # test-side patch: 0.16.1's router GEMM names te_general_gemm, defined only when Transformer Engine imports
    _patch(moe_utils, "te_general_gemm", None)
    from megatron.core.pipeline_parallel import schedules

    _patch(schedules, "torch", _CpuTokenCounterTorch())  # test-side patch: the schedules' token counter on "cuda"
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    local_init = DotProductAttention.__init__

    def init_without_cp(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        """Stand-in: the local attention (no CP support) attends within its rank's CP slice."""
        if config.context_parallel_size > 1:
            config = copy.copy(config)
            config.context_parallel_size = 1
        local_init(self, config, *args, **kwargs)

    _patch(DotProductAttention, "__init__", init_without_cp)  # test-side patch: attention stand-in under CP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    torch_norm_new = WrappedTorchNorm.__new__

    def norm_under_sp(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        """Stand-in: torch's LayerNorm under sequence parallel (forward identical; grads not summed over TP)."""
        if config.sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        return torch_norm_new(cls, config, *args, **kwargs)

    _patch(WrappedTorchNorm, "__new__", norm_under_sp)  # test-side patch: Apex's SP-aware norm is not installed


def unpatch_cpu() -> None:
    """Undo every test-side patch (latest first): the rest of a pytest session sees torch and Megatron as shipped."""
    while _SAVED:
        owner, name, original = _SAVED.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def close_parallel() -> None:
    """Tear down what :func:`init_parallel` set up: Megatron's parallel state, the process group, the patches."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    new_model_state()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    unpatch_cpu()


class _CpuTokenCounterTorch(types.ModuleType):
    """``torch`` for Megatron's schedules module, except ``zeros(device="cuda")`` (its token counter) on the CPU."""

    def __init__(self) -> None:
        """Stand in for ``torch`` in one module."""
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        """Everything else is torch's own."""
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros`` with ``device="cuda"`` read as the CPU."""
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def seed_rng_tracker(seed: int = 1234) -> None:
    """Register CPU RNG states in Megatron's RNG tracker (in place of ``model_parallel_cuda_manual_seed``)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    names = (
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
    )
    for offset, name in enumerate(names):
        tracker.states_[name] = torch.Generator().manual_seed(seed + 2718 * (offset + 1)).get_state()
        tracker.seeds_.add(seed + 2718 * (offset + 1))
    tracker._is_initialized = True
    torch.manual_seed(seed)


def free_port() -> int:
    """A free loopback TCP port for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_parallel(
    *,
    rank: int = 0,
    world_size: int = 1,
    port: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
) -> None:
    """Start gloo on loopback and Megatron's ``parallel_state`` (TP / PP / CP sizes); patches the CPU first."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    patch_cpu()
    if not dist.is_initialized():
        port = port or free_port()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=TIMEOUT_MINUTES),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        distributed_timeout_minutes=TIMEOUT_MINUTES,
    )
    seed_rng_tracker()


def new_model_state() -> None:
    """Clear what a previous model left process-wide: RouterReplay's global list and the MoE metrics tracker."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    clear_aux_losses_tracker()


@dataclass(frozen=True)
class ModelSpec:
    """A tiny GPT: ``moe_pattern[i]`` is 1 where decoder layer i+1 is MoE (0: dense)."""

    moe_pattern: tuple[int, ...] = (0, 1, 1)
    num_experts: int = 8
    topk: int = 2
    mtp_layers: int = 0
    recompute: bool = False
    sequence_parallel: bool = False
    config_overrides: dict[str, Any] = field(default_factory=dict)


def transformer_config(spec: ModelSpec) -> Any:
    """Megatron's ``TransformerConfig`` for ``spec`` with the current parallel sizes and routing replay on."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=len(spec.moe_pattern),
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN,
        moe_ffn_hidden_size=HIDDEN,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.topk,
        moe_layer_freq=list(spec.moe_pattern),
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        sequence_parallel=spec.sequence_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bf16=False,
        fp16=False,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # plain send / recv (gloo has no batched P2P); fixed shapes, so none are exchanged
        kwargs.update(
            pipeline_dtype=torch.float32,
            batch_p2p_comm=False,
            variable_seq_lengths=False,
            virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        )
    if spec.mtp_layers:
        kwargs.update(mtp_num_layers=spec.mtp_layers, mtp_loss_scaling_factor=0.1)
    if spec.recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(spec.config_overrides)
    return TransformerConfig(**kwargs)


def build_gpt(spec: ModelSpec = ModelSpec(), *, vp_stage: int | None = None) -> Any:
    """This rank's ``GPTModel`` chunk for ``spec`` (local spec, local experts, allgather dispatcher), in train mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    mtp = (
        get_gpt_mtp_block_spec(config, block, use_transformer_engine=False, vp_stage=vp_stage)
        if spec.mtp_layers
        else None
    )
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=MAX_SEQ,
        pre_process=pre,
        post_process=post,
        mtp_block_spec=mtp,
        vp_stage=vp_stage,
        position_embedding_type="learned_absolute",
    )
    return model.train()


def causal_mask(seq_len: int) -> torch.Tensor:
    """The explicit causal attention mask the local attention needs: True where attention is masked out."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


def routers(model: Any) -> list[Any]:
    """Every ``TopKRouter`` in ``model`` (module order), MTP routers included."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@dataclass
class RouterCall:
    """One router forward: its ``routing_map`` (``[tokens, experts]`` bool) and whether grad was on (recompute)."""

    routing_map: torch.Tensor
    grad_enabled: bool

    def chosen(self) -> list[list[int]]:
        """The expert ids chosen per token, ascending."""
        return [row.nonzero().flatten().tolist() for row in self.routing_map]


class RouterChoices:
    """What every ``TopKRouter`` of the models chose, from forward hooks on the routers' ``routing_map`` output.

    Calls are kept per router (keyed by the router object) in call order: a forward, then its recompute in the
    backward when recompute is on. Independent of rr's feeder and of ``RouterReplay``'s own state.
    """

    def __init__(self, models: Sequence[Any]) -> None:
        """Hook every router of ``models``."""
        self.calls: dict[Any, list[RouterCall]] = defaultdict(list)
        self.routers = [r for m in models for r in routers(m)]
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, router: Any, args: Any, output: Any) -> None:
        """Keep the router's ``routing_map`` (which experts each token goes to, after any token dropping)."""
        _probs, routing_map = output
        self.calls[router].append(
            RouterCall(routing_map.detach().to("cpu", torch.bool).clone(), torch.is_grad_enabled())
        )

    def layer_numbers(self) -> dict[Any, int]:
        """Each hooked router's ``layer_number`` (global 1-based decoder layer; MTP restarts)."""
        return {r: int(r.layer_number) for r in self.routers}

    def clear(self) -> None:
        """Forget recorded calls (keep the hooks)."""
        self.calls.clear()

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()


def rows_to_map(rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[tokens, topk]`` expert ids as a ``[tokens, experts]`` bool map (a router's choice is a set)."""
    out = torch.zeros(rows.shape[0], num_experts, dtype=torch.bool)
    return out.scatter_(1, rows.to(torch.int64), True)


def assert_chose(call: RouterCall, rows: torch.Tensor, what: str = "router") -> None:
    """Fail naming the first token whose chosen experts differ from ``rows`` (``[tokens, topk]``)."""
    want = rows_to_map(rows, call.routing_map.shape[1])
    assert call.routing_map.shape == want.shape, (
        f"{what}: {call.routing_map.shape[0]} tokens routed, {want.shape[0]} rows"
    )
    bad = (call.routing_map != want).any(dim=1).nonzero().flatten()
    if bad.numel():
        t = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {want.shape[0]} tokens differ; token {t} chose "
            f"{call.routing_map[t].nonzero().flatten().tolist()}, rows say "
            f"{sorted(rows[t].tolist())}"
        )


def sequence_first(per_sample: torch.Tensor) -> torch.Tensor:
    """``[b, s, K]`` rows to the router's token order (``[s, b]`` flattened: row = s_idx * b + b_idx)."""
    return per_sample.transpose(0, 1).reshape(-1, per_sample.shape[-1])


def random_rows(batch: int, seq: int, layers: int, num_experts: int, topk: int, seed: int = 0) -> torch.Tensor:
    """Rollout-like rows ``[b, s, layers, topk]``: distinct expert ids per token, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, seq, layers, num_experts, generator=g)
    return scores.topk(topk, dim=-1).indices.to(torch.int32)


@contextmanager
def hooked(models: Sequence[Any]) -> Iterator[RouterChoices]:
    """:class:`RouterChoices` on ``models`` for the block, hooks removed after."""
    choices = RouterChoices(models)
    try:
        yield choices
    finally:
        choices.remove()


def env_threads() -> None:
    """One intra-op thread per process: two ranks share this machine's few cores."""
    torch.set_num_threads(int(os.environ.get("RR_TEST_TORCH_THREADS", "1")))
