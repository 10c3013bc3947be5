"""``RRRollout``: TRL's ``rollout_func`` over :class:`rr_client.RoutedExpertsClient`: samples, the engine's
sampling log-probs and the checked routing, one ``n`` request per prompt group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rr_client.core.errors import ConfigurationError, ReplayError
from rr_client.core.info import RRInfo
from rr_client.integrations._loop import LoopThread
from rr_client.integrations.trl._gate import check_trl_version
from rr_client.integrations.weight_sync import WeightEngine

__all__ = ["RRRollout", "Rollout", "ROUTING_KEY", "sampling_params_from", "sampled_logprobs"]

ROUTING_KEY = "rr_rollout"
"""The extra key :class:`RRRollout` returns its routing under (TRL would pass it to reward functions)."""


@dataclass(frozen=True)
class Rollout:
    """One generation's samples (TRL's order) and the routing dimensions they were checked against."""

    results: list[Any]  # rr_client.GenerateResult
    info: RRInfo


def sampling_params_from(args: Any, n: int) -> dict[str, Any]:
    """rr ``/generate`` sampling params from a ``GRPOConfig`` (its ``generation_kwargs`` win), ``n`` samples."""
    sp: dict[str, Any] = {
        "n": n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k if args.top_k else -1,  # TRL: 0 = off; rr/SGLang: -1 = off
        "repetition_penalty": args.repetition_penalty,
    }
    if args.max_completion_length is not None:
        sp["max_new_tokens"] = args.max_completion_length
    if args.min_p is not None:
        sp["min_p"] = args.min_p
    extra = args.generation_kwargs or {}
    if isinstance(extra, str):
        raise ConfigurationError("GRPOConfig.generation_kwargs must be a dict for RRRollout")
    sp.update(extra)
    return sp


def sampled_logprobs(r: Any) -> list[float]:
    """The sampled tokens' log-probs from ``GenerateResult.logprobs`` (parsed and checked against the tokens
    once, by the client), NaN where the engine gave none: what TRL's ``rollout_func`` contract expects."""
    lp = getattr(r, "logprobs", None)
    if lp is None:
        raise ReplayError(
            f"sample {r.index}: the engine returned no log-probs for its {len(r.output_ids)} tokens "
            "(RRRollout asks for them: return_logprob=True)"
        )
    if len(lp) != len(r.output_ids):
        raise ReplayError(f"sample {r.index}: {len(lp)} log-probs for {len(r.output_ids)} tokens")
    return [float(x) for x in lp]


class RRRollout:
    """TRL ``rollout_func`` over :class:`rr_client.RoutedExpertsClient`: samples, their log-probs and routing.

    ``base_url``: one rr server or a list of replicas (load-balanced by the client). ``engines``: where the
    trainer pushes weights, when ``base_url`` is a router or rr's sidecar (default: ``base_url``): URLs of rr
    servers, or :class:`rr_client.integrations.weight_sync.WeightEngine` ``(url, "vllm"|"sglang")`` for an
    unpatched engine behind the sidecar. ``api_key`` is sent on every call, generation and weight sync alike
    (default: ``RR_API_KEY``). ``sampling_params`` override those taken from the ``GRPOConfig``;
    ``client_options`` go to the client (``timeout``, ``max_concurrency``, ...). Use it with
    :class:`R3GRPOTrainer` only: TRL's own ``GRPOTrainer`` would hand the routing to the reward functions.
    ``by_reference``: the servers keep the rows and answer refs; the trainer reads each micro-batch's rows when
    it runs it (a rank reads only its own), and retires the rows of older weights after each weight push.
    ``indexer``: also ask for the sparse-attention indexer picks (DeepSeek-V3.2-style models on rr-patched SGLang
    0.5.23+), which R3GRPOTrainer replays beside the routing; they travel by reference (the server's default,
    about 244 KiB per token for DeepSeek-V3.2) and are read per micro-batch like the routing.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        engines: str | WeightEngine | Sequence[str | WeightEngine] | None = None,
        engine_urls: str | Sequence[str] | None = None,
        api_key: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        by_reference: bool = False,
        indexer: bool = False,
        **client_options: Any,
    ) -> None:
        check_trl_version()
        from rr_client.client import RoutedExpertsClient

        if engines is not None and engine_urls is not None:
            raise ConfigurationError("RRRollout: pass engines= (engine_urls= is its older name), not both")
        self.urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not self.urls:
            raise ConfigurationError("RRRollout needs at least one server URL")
        eng = engines if engines is not None else engine_urls if engine_urls is not None else self.urls
        self.engines: list[str | WeightEngine] = [eng] if isinstance(eng, (str, WeightEngine)) else list(eng)
        self.api_key = api_key
        self.by_reference = by_reference
        self.indexer = indexer
        self.sampling_params = dict(sampling_params or {})
        self._weight_version = -1  # the newest weight version seen in a ref (retired after the next push)
        self._loop = LoopThread()
        target = self.urls if len(self.urls) > 1 else self.urls[0]

        async def make() -> RoutedExpertsClient:
            return RoutedExpertsClient(target, api_key=api_key, **client_options)

        self.client = self._loop.run(make())

    @property
    def engine_urls(self) -> list[str]:
        """The URLs weights are pushed to."""
        return [e.url if isinstance(e, WeightEngine) else e for e in self.engines]

    def info(self) -> RRInfo:
        """The served model's ``/rr/info`` (cached by the client)."""
        return self._loop.run(self.client.info())

    def generate(self, prompts: list[list[int]], sampling_params: Mapping[str, Any]) -> Any:
        """``client.generate`` with the sampling log-probs, on the rollout's loop (a :class:`GenerateBatch`)."""
        batch = self._loop.run(
            self.client.generate(
                prompts,
                dict(sampling_params),
                return_logprob=True,
                by_reference=self.by_reference,
                **({"return_indexer_topk": True} if self.indexer else {}),
            )
        )
        refs = [ref for r in batch for ref in (r.routing_ref, r.indexer_ref) if ref is not None]
        versions = [ref.weight_version for ref in refs]
        self._weight_version = max([self._weight_version, *versions])
        return batch

    def resolve(self, results: Sequence[Any]) -> list[Any]:
        """``results`` with their refs' rows read (by reference); the others as they are."""
        return self._loop.run(self.client.resolve_results(list(results)))

    def retire(self) -> None:
        """After a weight push: free every server's rows made under the weights seen so far (by reference)."""
        if (self.by_reference or self.indexer) and self._weight_version >= 0:
            self._loop.run(self.client.retire(self._weight_version))

    def close(self) -> None:
        """Close the client and its loop thread."""
        self._loop.run(self.client.aclose())
        self._loop.close()

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        if not getattr(type(trainer), "replays_rr_rollouts", False):  # R3GRPOTrainer (no import: it imports us)
            raise ConfigurationError(
                "RRRollout returns routing that only R3GRPOTrainer replays; with "
                f"{type(trainer).__name__} TRL would pass it to the reward functions and train "
                "without replay. Use rr_client.integrations.trl.R3GRPOTrainer (r3=False for "
                "plain GRPO)"
            )
        prompt_ids, images, mm = trainer._tokenize_prompts(prompts)
        if images is not None or mm:
            raise ReplayError("RRRollout: multimodal prompts are not supported (rr's /generate takes token ids only)")
        n = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        groups = len(prompt_ids) // n if n and len(prompt_ids) % n == 0 else 0
        if groups and all(prompt_ids[g * n + j] == prompt_ids[g * n] for g in range(groups) for j in range(n)):
            unique, per = [prompt_ids[g * n] for g in range(groups)], n  # TRL repeats each prompt n times in a row
        else:
            unique, per = prompt_ids, 1
        sp = {**sampling_params_from(trainer.args, per), **self.sampling_params, "n": per}
        batch = self.generate(unique, sp)
        results = list(batch)
        if len(results) != len(prompt_ids):
            raise ReplayError(f"RRRollout: {len(results)} samples for {len(prompt_ids)} prompts")
        return {
            "prompt_ids": [r.prompt_ids for r in results],
            "completion_ids": [list(r.output_ids) for r in results],
            "logprobs": [sampled_logprobs(r) for r in results],
            ROUTING_KEY: Rollout(results, batch.info),
        }
