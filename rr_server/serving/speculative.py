"""Speculative decoding and routing: which launch flags turn it on, and the refusal on releases whose draft layers
write the target model's routing rows (vLLM #48622, fixed in 0.30; SGLang #26980, opt-out from 0.5.23).

Silent upstream: the rows keep their shape and id range, only a ground-truth comparison shows them wrong, so rr's
launchers refuse the combination instead of serving it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rr_server.serving.engines import releases

__all__ = ["speculative_flags", "draft_pollution_refusal"]

# vLLM: --speculative-config (JSON); SGLang: --speculative-algorithm, --speculative-draft-model-path, ...
_PREFIXES = ("--speculative-", "--speculative_")


def speculative_flags(argv: Sequence[str]) -> list[str]:
    """The ``--speculative-*`` flags in an engine's arguments (both spellings, ``--flag=value`` too)."""
    return [a.split("=", 1)[0] for a in argv if a.startswith(_PREFIXES)]


def draft_pollution_refusal(engine: str, version: str, argv: Sequence[str]) -> str | None:
    """The launcher's refusal message when ``argv`` turns speculative decoding on for an affected release, else None."""
    flags = speculative_flags(argv)
    if not flags:
        return None
    rel = releases(engine)
    facts, fix, issue = rel.facts_for(version), rel.draft_fix_release, rel.draft_issue
    if not facts.draft_pollutes_routing:
        return None
    return (
        f"{engine} {version} with speculative decoding ({', '.join(sorted(set(flags)))}): its draft (MTP/EAGLE) "
        f"MoE layers write the target model's routing rows ({issue}), silently - the rows keep their shape and "
        f"id range. Upgrade to {engine} >= {fix}, or serve without speculative decoding"
    )
