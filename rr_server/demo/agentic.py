"""``python -m rr_server.demo.agentic --base-url URL --model-dir DIR``: an agentic loop written with ``Trajectory``.

Against a running rr vLLM server (``make demo`` runs it on its own server): a model turn, tool tokens, another
turn, ... then trainer-ready tensors from ``to_tensors([traj, ...])``, their routing compared with transformers'
router top-k on every token, and the bytes received per trajectory with incremental ``routed_experts_start``
versus asking for every row each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import httpx

__all__ = ["agentic_rollout", "resent_rollout", "bytes_per_trajectory", "run_agentic", "main"]

PROMPT = "Once upon a time there was a router on a CPU."
TOOL_TEXT = " tool result {turn}: 1 2 3 4 5 6 7 8"


class CountingTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that counts the response bytes of generate calls: whole bodies and routing payloads."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.bytes = 0
        self.routing_bytes = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self._inner.handle_async_request(request)
        body = await resp.aread()
        if request.url.path.endswith("generate"):
            self.bytes += len(body)
            items = json.loads(body) if resp.status_code == 200 else []
            for item in items if isinstance(items, list) else [items]:
                payload = item.get("meta_info", {}).get("routed_experts")
                self.routing_bytes += len(payload) if isinstance(payload, str) else 0
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def agentic_rollout(
    client: Any, prompt_ids: list[int], tool_ids: Any, *, turns: int, params: dict[str, Any]
) -> Any:
    """The agentic loop: model turn, tool tokens, model turn, ...; returns the Trajectory."""
    traj = client.trajectory(prompt_ids)
    for turn in range(turns):
        await traj.generate(params)  # sends every token, asks only for rows it does not hold
        if turn < turns - 1:
            traj.extend(tool_ids(turn))  # environment tokens: loss_mask False
    return traj


async def resent_rollout(
    client: Any, prompt_ids: list[int], tool_ids: Any, *, turns: int, params: dict[str, Any]
) -> list[int]:
    """The same conversation, asking for every routing row on every turn (what a naive loop does); its tokens."""
    ids = list(prompt_ids)
    for turn in range(turns):
        res = (await client.generate([ids], params, routed_experts_start=0))[0]
        ids += res.output_ids
        if turn < turns - 1:
            ids += tool_ids(turn)
    return ids


async def bytes_per_trajectory(
    base_url: str, prompt_ids: list[int], tool_ids: Any, *, turns: int, params: dict[str, Any]
) -> tuple[int, CountingTransport, CountingTransport]:
    """(tokens, incremental counts, re-asking-every-row counts) for one trajectory."""
    from rr_client import RoutedExpertsClient

    inc, full = CountingTransport(), CountingTransport()
    async with RoutedExpertsClient(base_url, transport=inc) as c:
        traj = await agentic_rollout(c, prompt_ids, tool_ids, turns=turns, params=params)
    async with RoutedExpertsClient(base_url, transport=full) as c:
        await resent_rollout(c, prompt_ids, tool_ids, turns=turns, params=params)
    return len(traj), inc, full


def run_agentic(base_url: str, model_dir: str, *, turns: int = 3, batch: int = 4, max_new_tokens: int = 16) -> bool:
    """Run the loop for a batch of trajectories, check against transformers, print tensors and bytes; True if exact."""
    from transformers import AutoTokenizer

    from rr_client import RoutedExpertsClient, to_tensors
    from rr_client.core.agreement import count_matches
    from rr_server.demo.tiny_moe import reference_routing

    tok = AutoTokenizer.from_pretrained(model_dir)

    def tool_ids(turn: int) -> list[int]:
        return list(tok(TOOL_TEXT.format(turn=turn))["input_ids"])

    prompt = list(tok(PROMPT)["input_ids"])

    async def rollouts() -> tuple[list[Any], Any]:
        async with RoutedExpertsClient(base_url) as c:
            trajs = await asyncio.gather(
                *(
                    agentic_rollout(
                        c,
                        prompt,
                        tool_ids,
                        turns=turns,
                        params={"max_new_tokens": max_new_tokens, "temperature": 0.8, "seed": 100 + i},
                    )
                    for i in range(batch)
                )
            )
            return list(trajs), await c.info()

    trajs, info = asyncio.run(rollouts())
    tensors = to_tensors(trajs, info, pad_side="right")
    print(f"\nagentic rollouts: {batch} trajectories x {turns} model turns with tool tokens in between")
    print(
        f"to_tensors: input_ids {tuple(tensors.input_ids.shape)}, routed_experts {tuple(tensors.routed_experts.shape)} "
        f"{tensors.routed_experts.dtype}, response_mask (model tokens only) "
        f"{int(tensors.response_mask.sum())} of {int(tensors.attention_mask.sum())} tokens"
    )
    match = total = 0
    for i, t in enumerate(trajs):
        ids = t.input_ids
        got = tensors.routed_experts[i, : len(ids) - 1].numpy()
        ref = reference_routing(model_dir, ids)[:-1]
        m, n = count_matches(got, ref, layers=info.moe_layers)
        match, total = match + m, total + n
    print(
        f"trajectory routing vs transformers' router top-k over the whole sequence: {match}/{total} = "
        f"{100.0 * match / max(1, total):.2f}%"
    )
    print("\nbytes received per trajectory, incremental routed_experts_start vs every row re-sent each turn")
    print("(routing: base64 payloads only; body: whole /generate answers, token ids and text included)")
    print(" turns  tokens  routing inc B  routing re-sent B  ratio  body inc B  body re-sent B  ratio")
    for n_turns in (2, turns, 2 * turns):
        n_tok, inc, full = asyncio.run(
            bytes_per_trajectory(
                base_url,
                prompt,
                tool_ids,
                turns=n_turns,
                params={"max_new_tokens": max_new_tokens, "temperature": 0.8, "seed": 7},
            )
        )
        print(
            f"{n_turns:>6}  {n_tok:>6}  {inc.routing_bytes:>13}  {full.routing_bytes:>17}  "
            f"{inc.routing_bytes / full.routing_bytes:5.2f}  {inc.bytes:>10}  {full.bytes:>14}  "
            f"{inc.bytes / full.bytes:5.2f}"
        )
    return bool(total) and match == total


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (needs a running server: ``--base-url``)."""
    p = argparse.ArgumentParser(prog="python -m rr_server.demo.agentic", description=__doc__)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model-dir", required=True, help="the served checkpoint (for transformers' reference)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args(argv)
    return 0 if run_agentic(args.base_url, args.model_dir, turns=args.turns, batch=args.batch) else 1


if __name__ == "__main__":
    sys.exit(main())
