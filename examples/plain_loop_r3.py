"""R3 in a plain PyTorch training loop: rollouts with routing from an rr server, replayed by a ReplaySession.

No trainer framework: generate with :class:`rr_client.RoutedExpertsClient`, lay the samples out with
``to_tensors``, and let :class:`rr_client.trainer.ReplaySession` replay the engine's routing in the forward and
the backward, audit it and measure the log-prob gap to the engine. The stale-rows policy runs where the rows enter
the session (``open_replay``): ``to_tensors`` carries each sample's provenance, so a sample the server says was
recomputed across a weight update is refused (``StaleRoutingError``, the default), or with ``--stale-rows mask``
trained with its rows left to the router, and counted (``r3/stale_masked``); ``--stale-rows off`` turns it off on
purpose. A REINFORCE-style loss with a toy reward
(the share of a completion's tokens in the lower half of the vocabulary: it varies from sample to sample, so the
loss moves) stands in for your objective; TRL's importance-sampling correction (its
default, ``sequence_mask`` at 3: ``importance_sampling_ratio``) weighs each sample by how far the trainer's
policy is from the engine's that sampled it.

    rr-server launch vllm --model <moe checkpoint> --port 8000 ...      # or sglang, or the sidecar
    python examples/plain_loop_r3.py --url http://127.0.0.1:8000 --model-path <the same checkpoint> [--weight-sync]

``--weight-sync`` pushes the trainer's weights to the engine before every rollout, as a real RL loop does
(:class:`rr_client.integrations.weight_sync.DiskWeightSync`: saved under ``--sync-dir``, reloaded by the engine
from there; vLLM needs ``VLLM_SERVER_DEV_MODE=1`` for its reload route): the engine then samples from the policy
being trained, so the trainer's own router keeps agreeing with the engine's (``r3/agreement`` 1.0 in fp32) and the
log-prob gap stays at rounding. The first push resets the engine to the starting weights. Without it the engine
keeps the weights it serves and one line says what follows: the trainer drifts away from them, so its agreement
falls and the gap grows step by step, while replay still runs the engine's experts.

Prints one line of metrics per step (``r3/applied_share`` 1.0: every replayed id reached its experts;
``r3/mean_abs_logp_diff``: the trainer's log-probs vs the engine's, small when their weights match). ``--indexer``
(a DeepSeek-V3.2-style model on rr-patched SGLang 0.5.23+, launched with ``--enable-return-indexer-topk``): the
sparse-attention indexer's picks are replayed beside the routing, audited under ``r3/indexer/``; another server
is refused in one line from its ``/rr/info``, before the model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from rr_client import ConfigurationError, GenerateBatch, RoutedExpertsClient, RRInfo
from rr_client.integrations.weight_sync import DiskWeightSync
from rr_client.trainer import ReplaySession, keys
from rr_client.trainer.correction import importance_sampling_ratio
from rr_client.trainer.metrics import token_logprobs

PROMPTS = ["The capital of France is", "Mixture of experts models route each token", "1, 2, 3, 4,"]
NO_SYNC_NOTE = (
    "weights not pushed (--weight-sync pushes them every step): the engine keeps serving its starting weights while "
    "the trainer moves away from them, so the trainer's own router agrees less with the engine's picks and the "
    "log-prob gap grows step by step; replay still runs the engine's experts (applied 1.000)"
)


async def server_info(url: str) -> RRInfo:
    """The server's ``/rr/info``: the model and engine facts (one request)."""
    async with RoutedExpertsClient(url) as client:
        return await client.info()


def check_indexer_capture(info: RRInfo, url: str) -> None:
    """Refuse ``--indexer`` (:class:`rr_client.ConfigurationError`, one line) unless ``info`` says the server can
    return indexer picks to replay: an rr-patched SGLang serving a sparse-attention model, its indexer capture not
    refused. Checked before the trainer's model is loaded, so a wrong server costs one request, not a load."""
    need = "--indexer: indexer picks need an rr-patched SGLang 0.5.23+ launched with --enable-return-indexer-topk"
    refused = (info.model_extra or {}).get("capture_refused") or {}
    if info.engine != "sglang":
        raise ConfigurationError(
            f"{need}; {url} is {info.engine} {info.engine_version}, which captures no indexer top-k"
        )
    if info.indexer is None:
        raise ConfigurationError(
            f"{need}, serving a sparse-attention (DSA) model; the model {url} serves has no indexer"
        )
    if isinstance(refused, dict) and refused.get("indexer_topk"):
        raise ConfigurationError(f"{need}; {url} refuses its indexer picks: {refused['indexer_topk']}")


async def rollout(
    url: str, prompts: list[list[int]], params: dict[str, Any], by_reference: bool = False, indexer: bool = False
) -> GenerateBatch:
    """One rollout: completions of each prompt sampled with ``params``, with routing and the engine's log-probs.

    ``by_reference``: the server keeps the rows and answers refs (what a controller would hand to trainer ranks);
    each rank then resolves only its own samples' rows, here the one rank all of them. ``indexer``: the
    sparse-attention indexer's picks too (DeepSeek-V3.2-style models on rr-patched SGLang 0.5.23+), by reference
    (the server's default: about 244 KiB per token for DeepSeek-V3.2), read in the same resolve."""
    async with RoutedExpertsClient(url) as client:
        batch = await client.generate(
            prompts, params, return_logprob=True, by_reference=by_reference, return_indexer_topk=indexer
        )
        if by_reference or indexer:
            batch = GenerateBatch(await client.resolve_results(batch.results), batch.info)
        return batch


@contextmanager
def weight_sync(args: argparse.Namespace) -> Iterator[DiskWeightSync | None]:
    """With ``--weight-sync``, the weight push to ``args.url`` (saved under ``--sync-dir``, default a temporary folder
    removed at the end); else None, after printing what that leaves the engine on and what follows."""
    if not args.weight_sync:
        print(NO_SYNC_NOTE)
        yield None
        return
    with (
        tempfile.TemporaryDirectory(prefix="rr-plain-loop-") as tmp,
        DiskWeightSync(args.url, args.sync_dir or Path(tmp)) as sync,
    ):
        yield sync


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--by-reference", action="store_true", help="routing by reference (rows read from the server)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the trainer's too)")
    ap.add_argument("--indexer", action="store_true", help="replay the sparse-attention indexer's picks too (DSA)")
    ap.add_argument(
        "--seed", type=int, default=None, help="sampling seed (step s samples with seed + s): repeatable runs"
    )
    ap.add_argument(
        "--stale-rows",
        choices=["refuse", "mask", "off"],
        default="refuse",
        help="samples recomputed across a weight update: refused, masked (left to the router) or kept",
    )
    ap.add_argument(
        "--weight-sync",
        action="store_true",
        help="push the weights to the engine before every rollout (vLLM: VLLM_SERVER_DEV_MODE=1); default: it keeps "
        "the weights it serves, and the trainer drifts away from them step by step",
    )
    ap.add_argument(
        "--sync-dir",
        type=Path,
        default=None,
        help="where the pushed weights are saved, a folder the engine can read (default: a temporary one)",
    )
    args = ap.parse_args(argv)
    if args.indexer:  # one /rr/info request: a server without indexer capture is refused before the model loads
        check_indexer_capture(asyncio.run(server_info(args.url)), args.url)

    transformers.utils.logging.disable_progress_bar()  # the weight push's shard bar, once per step
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_path)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # audit every step here (the default is every 10th); the stale-rows policy runs in open_replay
    session = ReplaySession(model, audit_every=1, stale_rows=args.stale_rows)
    # the sampling params, also what the engine's log-probs are checked against: raw (pre-temperature) ones are
    # refused at a temperature other than 1 or with top_k / top_p / min_p / a penalty on
    params = {"n": args.samples, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    history = []
    with weight_sync(args) as sync:  # None without --weight-sync
        # ------------------------------------------------------------ the loop
        for step in range(args.steps):
            # the engine samples from the weights being trained (step 0: the start); WeightSyncError if it cannot
            synced = sync.push(model, step) if sync is not None else None
            step_params = params if args.seed is None else {**params, "seed": args.seed + step}
            batch = asyncio.run(rollout(args.url, prompts, step_params, args.by_reference, args.indexer))
            rt = batch.to_tensors(pad_side="right")
            response = rt.response_mask.bool()
            vocab = model.config.vocab_size
            reward = torch.tensor([float(np.mean(np.asarray(r.output_ids) < vocab // 2)) for r in batch])
            advantage = (reward - reward.mean()) / (reward.std() + 1e-6)

            model.train()
            with session.step() as metrics:  # closes the replay block after backward; audit verdicts raise here
                session.open_replay(rt)  # the stale-rows policy on rt's provenance, then the engine's routing (and
                # indexer picks, rt.indexer_topk, with --indexer) replayed
                logits = model(rt.input_ids, attention_mask=rt.attention_mask).logits
                logps = token_logprobs(logits / args.temperature, rt.input_ids)  # what the engine sampled from
                # TRL's correction: exp(sum of (trainer - engine) log-probs) per sample, 0 above 3 (detached), with the
                # engine's log-probs beside the tokens (rt.logprobs, of rt.logprobs_mode: processed from rr's launchers)
                ratio = importance_sampling_ratio(
                    logps.detach(), rt, response, mode="sequence_mask", clip_min=None, clip_max=3.0, sampling=params
                )
                per_sample = (ratio * logps * response).sum(-1) / response.sum(-1).clamp(min=1)
                loss = -(advantage * per_sample).mean()
                loss.backward()
                session.add_gap(logps, rt, response, sampling=params)  # refuses raw ones that would not compare
            optimizer.step()
            optimizer.zero_grad()

            history.append(
                {"step": step, "loss": loss.item(), "reward": reward.mean().item(), "reward_std": reward.std().item(),
                 keys.IS_RATIO_MEAN: ratio.mean().item(), **metrics}
            )  # fmt: skip
            print(
                f"step {step}: reward {reward.mean().item():.3f}  loss {loss.item():+.4f}  "
                f"applied {metrics[keys.APPLIED_SHARE]:.3f}  "
                f"agreement {metrics[keys.AGREEMENT]:.3f}  |logp gap| {metrics[keys.MEAN_ABS_LOGP_DIFF]:.2e}  "
                f"stale masked {metrics[keys.STALE_MASKED]:.0f}"
                + (f"  indexer applied {metrics[keys.INDEXER_APPLIED_SHARE]:.3f}" if args.indexer else "")
                + (f"  weights pushed in {synced:.1f} s" if synced is not None else "  weights not pushed")
            )
        # ------------------------------------------------------------ end of the loop
    return history


if __name__ == "__main__":
    try:
        main()
    except ConfigurationError as e:  # a setting that cannot work: one line, no traceback
        raise SystemExit(f"plain_loop_r3.py: {e}") from None
