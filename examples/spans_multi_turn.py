"""A multi-turn training datum built from provenance spans of two samples, its routing resolved from an object store
after the engine may be gone, and replayed by a ReplaySession.

The server keeps each sample's rows as an object (``rr-server launch vllm --model M --rr-store s3://bucket/run``, or
``file:///shared/path``) and answers a ref. Each sample is a sequence of a session (:class:`rr_client.SequenceBook`,
its ``sequence_id`` bound to the sample's tokens by the ref's digest); the datum says which tokens came from which
sequence (prompt and sampled spans: ``sequence_id``, ``offset``, ``length``, in tiling order), and
:meth:`rr_client.RoutedExpertsClient.resolve_spans` returns one checked row per datum token::

    python examples/spans_multi_turn.py --url http://127.0.0.1:8000 --model-path M --store s3://bucket/run

The client reads the objects with its own credentials (fsspec's configuration, ``AWS_*``), only under the
prefixes it lists (``--store``), checked against the routing dims the server gave at rollout time: no server needs
to answer by then.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from rr_client import ProvenanceSpan, RoutedExpertsClient, RRInfo, SequenceBook

TOOL_ANSWER = [31, 32, 33, 34]  # what the environment answered after turn 1, tokenized
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


async def rollout(url: str, prompt_ids: list[int], store: str) -> tuple[SequenceBook, list[Any], RRInfo]:
    """Two turns by reference: the session's book of both samples, the samples, the server's routing dims (kept:
    the rows are checked against them later, when no server may answer)."""
    async with RoutedExpertsClient(url, object_stores=[store]) as client:
        (turn1,) = await client.generate([prompt_ids], GREEDY, by_reference=True)
        history = [*turn1.prompt_ids, *turn1.output_ids, *TOOL_ANSWER]
        (turn2,) = await client.generate([history], GREEDY, by_reference=True)
        info = await client.info()
    book = SequenceBook("episode-0")
    book.add_result("turn-1", turn1)
    book.add_result("turn-2", turn2)
    return book, [turn1, turn2], info


def datum_spans(turn1: Any, turn2: Any) -> list[ProvenanceSpan]:
    """The datum (every conversation token but the last) as spans: turn 1's prompt and sampled tokens it ran, then
    turn 2's prompt tokens turn 1 never ran (its last sampled token, the tool's answer), then turn 2's sampled ones."""
    ran1 = len(turn1.prompt_ids) + len(turn1.output_ids) - 1
    p2 = len(turn2.prompt_ids)
    return [
        ProvenanceSpan("turn-1", 0, len(turn1.prompt_ids), "prompt"),
        ProvenanceSpan("turn-1", len(turn1.prompt_ids), len(turn1.output_ids) - 1, "sampled"),
        ProvenanceSpan("turn-2", ran1, p2 - ran1, "prompt"),
        ProvenanceSpan("turn-2", p2, len(turn2.output_ids) - 1, "sampled"),
    ]


async def resolve(
    book: SequenceBook, spans: Sequence[ProvenanceSpan], datum: list[int], info: RRInfo, store: str
) -> np.ndarray:
    """The datum's rows, read from the objects (no server is asked: ``info`` is given, the URL is never called)."""
    async with RoutedExpertsClient("http://127.0.0.1:9", info=info, object_stores=[store]) as client:
        return await client.resolve_spans(book, spans, datum)


def replay(model_path: str, datum: list[int], rows: np.ndarray) -> dict[str, Any]:
    """One forward of the datum with the engine's experts replayed; the step's metrics (applied share ...)."""
    import torch
    import transformers

    from rr_client.trainer import ReplaySession

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    session = ReplaySession(model, audit_every=1)
    input_ids = torch.tensor([datum])
    with session.step() as metrics:
        session.open_replay(torch.from_numpy(rows.astype(np.int64))[None], torch.ones(1, len(datum), dtype=torch.bool))
        model(input_ids).logits.sum().backward()
    return dict(metrics)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-path", required=True, help="the served model's folder (the trainer's model)")
    ap.add_argument("--store", required=True, help="the server's --rr-store URL (s3://bucket/run, file:///path)")
    ap.add_argument("--prompt-ids", default="2,88,86,260,202", help="turn 1's prompt token ids, comma-separated")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    book, (turn1, turn2), info = asyncio.run(rollout(args.url, prompt, args.store))
    datum = [*turn2.prompt_ids, *turn2.output_ids][:-1]  # the trainer's inputs: the last token is only a target
    spans = datum_spans(turn1, turn2)
    rows = asyncio.run(resolve(book, spans, datum, info, args.store))
    metrics = replay(args.model_path, datum, rows)
    print(f"datum of {len(datum)} tokens from {len(spans)} spans of 2 samples: rows {tuple(rows.shape)}; "
          f"replay applied {metrics.get('r3/applied_share', float('nan')):.3f}")  # fmt: skip
    return {"rows": rows, "datum": datum, "metrics": metrics, "book": book, "spans": spans, "info": info}


if __name__ == "__main__":
    main()
