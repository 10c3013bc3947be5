"""The doctor's prefill/decode probe (``--pd-prefill URL --pd-decode URL --pd-bootstrap-port N``): the same greedy
prompts through a SGLang P/D pair (:class:`rr_client.PDClient`: each half checked, joined at the seam) and through the
server the doctor checks, alone. The pair's rows must equal that server's on the prompt (the prefill server's half)
and on the generated tokens (the decode server's half), with the same tokens generated; each sample's seam goes into
the report. The pair's samples join the ground truth (``--model-path``) too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rr_client import GenerateResult, PDClient, RRError
from rr_client.core.seam import SEAM_FIELD

__all__ = ["PDTarget", "check_pd", "SEAM_CHECK", "PROMPT_CHECK", "GENERATED_CHECK"]

SEAM_CHECK, PROMPT_CHECK, GENERATED_CHECK = "p/d seam", "p/d prompt rows", "p/d generated rows"


@dataclass(frozen=True)
class PDTarget:
    """A SGLang P/D pair: its prefill and decode servers' URLs and the prefill server's bootstrap port (and host,
    default the prefill URL's)."""

    prefill: str
    decode: str
    bootstrap_port: int
    bootstrap_host: str | None = None


class _Doc(Protocol):
    """What the probe needs of the doctor's run (:class:`rr_server.doctor.checks._Doctor`)."""

    params: dict[str, Any]
    samples: list[GenerateResult]
    report: Any

    def add(self, name: str, ok: bool, detail: str, exercised: bool = True) -> None: ...

    async def gen(self, prompts: list[list[int]], params: dict[str, Any] | None = None, **kw: Any) -> list[Any]: ...

    def rows_agree(self, name: str, a: Any, b: Any, what: str) -> None: ...


def _split(results: Sequence[GenerateResult]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's prompt rows and generated rows, each concatenated over the samples."""
    cut = [len(r.prompt_ids or []) - r.routed_experts_start for r in results]
    rows = [np.asarray(r.routed_experts) for r in results]
    return (
        np.concatenate([a[:c] for a, c in zip(rows, cut)]),
        np.concatenate([a[c:] for a, c in zip(rows, cut)]),
    )


async def check_pd(doc: _Doc, target: PDTarget, prompts: list[list[int]], api_key: str | None = None) -> None:
    """Run the probe; its checks go into ``doc`` and the seams into ``doc.report.seams``."""
    try:
        async with PDClient(
            target.prefill,
            target.decode,
            bootstrap_port=target.bootstrap_port,
            bootstrap_host=target.bootstrap_host,
            api_key=api_key,
            retries=1,
        ) as pd:
            pair = list(await pd.generate(prompts, doc.params))
    except RRError as e:
        doc.add(SEAM_CHECK, False, f"the pair's samples were refused: {type(e).__name__}: {e}")
        return
    doc.report.seams = [r.meta[SEAM_FIELD] for r in pair]
    doc.samples.extend(pair)
    at = [s["at"] for s in doc.report.seams]
    doc.add(
        SEAM_CHECK,
        True,
        f"{len(pair)} samples joined at tokens {at}: prompt rows from {target.prefill}, the rest from "
        f"{target.decode}, each half fully checked",
    )
    alone = await doc.gen(prompts)
    (pp, pg), (ap, ag) = _split(pair), _split(alone)
    doc.rows_agree(PROMPT_CHECK, pp, ap, "the pair's prompt rows (prefill server) vs the server alone")
    differ = [i for i, (a, b) in enumerate(zip(pair, alone)) if a.output_ids != b.output_ids]
    if differ:
        doc.add(
            GENERATED_CHECK,
            False,
            f"greedy decoding gave other tokens through the pair than alone for prompts {differ}: the decode server "
            "did not continue from the KV it was handed (or the two run other weights)",
        )
        return
    doc.rows_agree(GENERATED_CHECK, pg, ag, "the pair's generated-token rows (decode server) vs the server alone")


def render_seams(seams: list[dict[str, Any]]) -> list[str]:
    """The report's lines for the P/D seams."""
    if not seams:
        return []
    s = seams[0]
    return [
        f"\np/d seam ({len(seams)} samples; the first): token {s['at']}; prefill {s['prefill']['server']} "
        f"{s['prefill']['span']}, decode {s['decode']['server']} {s['decode']['span']}, weight version "
        f"{s['weight_version']}"
    ]
