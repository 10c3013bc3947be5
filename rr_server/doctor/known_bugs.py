"""Known routing bugs by engine version, and whether rr covers each on a given deployment (docs/engines.md).

Which releases have a bug is never written here: each entry names a fact of
:mod:`rr_server.serving.vllm_facts` or :mod:`rr_server.serving.sglang_facts`, the one place per engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rr_server.serving import sglang_facts, vllm_facts

__all__ = ["KnownBug", "BugStatus", "known_bugs_for"]

@dataclass(frozen=True)
class KnownBug:
    """One upstream bug: which releases have it and what rr does about it per deployment kind."""

    engine: str
    fact: str  # the boolean attribute of the engine's version facts that says a release has it
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
    KnownBug("vllm", "eplb_physical_ids", "captures physical expert ids after the EPLB remap",
             "rr refuses vLLM < 0.22", "not covered: the ids are in range, only ground truth shows it",
             "not covered: only --model-path ground truth shows it"),
    KnownBug("vllm", "all_zero_routing", "returns all-zero routing (fixed by PR #33013 in 0.16)",
             "rr refuses vLLM < 0.22", "covered: the full check refuses all-zero MoE rows (502)",
             "detected: the full check refuses all-zero MoE rows"),
    KnownBug("vllm", "nested_json_lists", "sends nested JSON lists (~40 MB per 30k-token sample)",
             "rr refuses vLLM 0.21", "covered: decoded and re-encoded as uint8 .npy", "decoded by the client"),
    KnownBug("vllm", "cpu_compile_zeros", "on CPU, torch.compile returns all-zero routing with the right shape",
             "covered: the launcher forces --enforce-eager on CPU and the full check refuses all-zero rows",
             "covered: the full check refuses all-zero MoE rows (502)",
             "detected: the full check refuses all-zero MoE rows"),
    KnownBug("vllm", "cpu_reload_unpacked_experts",
             "on CPU, reload_weights (weight sync) leaves the MoE experts' weights unpacked: the engine then serves "
             "wrong experts and wrong routing, with only a log warning ('weights were not loaded')",
             "covered: the plugin re-runs the CPU experts' prepack after every reload",
             "not covered: the sidecar cannot reach the engine's weights",
             "not detected here: rr's trainer weight sync checks the engine's log-probs after each sync"),
    KnownBug("sglang", "tensor_lost_as_json",
             "with --skip-tokenizer-init the raw tensor is JSON-encoded as {} (routing lost)",
             "covered: the patch encodes the tensor before FastAPI sees it",
             "not recoverable: the data is lost upstream; refused as MissingRoutingError, never passed on",
             "detected: refused as MissingRoutingError"),
    KnownBug("sglang", "mixed_batch_bug",
             "in a batch where only some requests ask, one request can receive another's rows (fixed in 0.5.13)",
             "covered: the patch asks for routing on every request", "covered: the sidecar asks on every request",
             "exposed: the mixed-batch check below tests it"),
    KnownBug("sglang", "ignores_start", "routed_experts_start_len is accepted but ignored",
             "covered: the patch slices the rows itself", "covered: the sidecar slices the rows itself",
             "exposed: the start check below tests it"),
    KnownBug("sglang", "drops_last_prompt_row", "max_new_tokens=0 loses the last prompt row (#20964)",
             "refused: the row count check fails, never shifted", "refused: the row count check fails",
             "refused by the client's row count check"),
)


def _facts(engine: str, version: str) -> Any:
    """The engine's version facts (ValueError for an unknown engine or unparsable version)."""
    try:
        if engine == "vllm":
            return vllm_facts.facts_for(version)
        if engine == "sglang":
            return sglang_facts.facts_for(version)
    except (vllm_facts.UnsupportedVLLMVersion, sglang_facts.UnsupportedSGLangError) as e:
        raise ValueError(str(e)) from None
    raise ValueError(f"unknown engine {engine!r}")


def known_bugs_for(engine: str, version: str, *, deployment: str) -> list[BugStatus]:
    """Bugs of ``engine`` ``version`` with rr's coverage for ``deployment`` in patched|sidecar|unpatched."""
    try:
        facts = _facts(engine, version)
    except ValueError:
        return [BugStatus(f"unknown {engine} version {version!r}", "cannot tell which known bugs apply")]
    return [BugStatus(bug.what, getattr(bug, deployment)) for bug in _BUGS
            if bug.engine == engine and getattr(facts, bug.fact)]
