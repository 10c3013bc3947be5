"""Known routing bugs by engine version, and whether rr covers each on a given deployment (docs/engines.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rr_patches.release import parse_release

__all__ = ["KnownBug", "BugStatus", "known_bugs_for"]

Release = tuple[int, int, int]


@dataclass(frozen=True)
class KnownBug:
    """One upstream bug: which releases have it and what rr does about it per deployment kind."""

    engine: str
    affected: Callable[[Release], bool]
    what: str
    patched: str  # what the rr-patched engine does about it
    sidecar: str  # what the sidecar does about it
    unpatched: str  # what a doctor run against the bare engine can say


@dataclass(frozen=True)
class BugStatus:
    """A known bug that applies to this deployment, with rr's coverage in words."""

    what: str
    coverage: str


_BUGS = (
    KnownBug("vllm", lambda r: (0, 14) <= r[:2] <= (0, 15), "captures physical expert ids after the EPLB remap",
             "rr refuses vLLM < 0.22", "not covered: the ids are in range, only ground truth shows it",
             "not covered: only --model-path ground truth shows it"),
    KnownBug("vllm", lambda r: r[:2] == (0, 15), "returns all-zero routing (fixed by PR #33013 in 0.16)",
             "rr refuses vLLM < 0.22", "covered: the full check refuses all-zero MoE rows (502)",
             "detected: the full check refuses all-zero MoE rows"),
    KnownBug("vllm", lambda r: r[:2] == (0, 21), "sends nested JSON lists (~40 MB per 30k-token sample)",
             "rr refuses vLLM 0.21", "covered: decoded and re-encoded as uint8 .npy", "decoded by the client"),
    KnownBug("vllm", lambda r: r[:2] >= (0, 14), "on CPU, torch.compile returns all-zero routing with the right shape",
             "covered: the launcher forces --enforce-eager on CPU and the full check refuses all-zero rows",
             "covered: the full check refuses all-zero MoE rows (502)",
             "detected: the full check refuses all-zero MoE rows"),
    KnownBug("sglang", lambda r: (0, 5, 7) <= r <= (0, 5, 9),
             "with --skip-tokenizer-init the raw tensor is JSON-encoded as {} (routing lost)",
             "covered: the patch encodes the tensor before FastAPI sees it",
             "not recoverable: the data is lost upstream; refused as MissingRoutingError, never passed on",
             "detected: refused as MissingRoutingError"),
    KnownBug("sglang", lambda r: (0, 5, 7) <= r <= (0, 5, 12),
             "in a batch where only some requests ask, one request can receive another's rows (fixed in 0.5.13)",
             "covered: the patch asks for routing on every request", "covered: the sidecar asks on every request",
             "exposed: the mixed-batch check below tests it"),
    KnownBug("sglang", lambda r: (0, 5, 8) <= r <= (0, 5, 11), "routed_experts_start_len is accepted but ignored",
             "covered: the patch slices the rows itself", "covered: the sidecar slices the rows itself",
             "exposed: the start check below tests it"),
    KnownBug("sglang", lambda r: r >= (0, 5, 7), "max_new_tokens=0 loses the last prompt row (#20964)",
             "refused: the row count check fails, never shifted", "refused: the row count check fails",
             "refused by the client's row count check"),
)


def known_bugs_for(engine: str, version: str, *, deployment: str) -> list[BugStatus]:
    """Bugs of ``engine`` ``version`` with rr's coverage for ``deployment`` in patched|sidecar|unpatched."""
    try:
        rel = parse_release(version)
    except ValueError:
        return [BugStatus(f"unknown {engine} version {version!r}", "cannot tell which known bugs apply")]
    out = []
    for bug in _BUGS:
        if bug.engine == engine and bug.affected(rel):
            out.append(BugStatus(bug.what, getattr(bug, deployment)))
    return out
