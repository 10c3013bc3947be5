"""Engine paths that write wrong but well-formed rows, refused in one place for the launcher, ``/rr/info`` and each
sample (issue 55, docs/engines.md "Capture paths refused"): SGLang's speculative tree verification
(sgl-project/sglang#37949) and its fused indexer top-k (KV slots, not token positions).

Such rows keep their shape and id range, so no check on the rows can see them; what the server runs decides. The
facts per release are :attr:`ReleaseFacts.tree_verify_moves_rows` and
:attr:`ReleaseFacts.indexer_positions_unfused_only` (a release rr has not read is refused, never assumed). A server's
``/rr/info`` carries the refusals in :data:`REFUSED_FIELD` (``{"routed_experts" | "indexer_topk": message}``) and
whether indexer picks are positions in :data:`POSITIONS_FIELD` (``None``: unknown, refused); every sample of a refused
kind carries the typed error instead of rows (:func:`capture_refusal`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rr_client.core.errors import (
    ConfigurationError,
    IndexerPositionError,
    RoutedExpertsError,
    StaleRoutingError,
    UnsupportedVersionError,
)
from rr_client.core.info import RRInfo
from rr_server.serving.engines import releases
from rr_server.serving.engines.base import ReleaseFacts, TreeVerify

__all__ = [
    "REFUSED_FIELD",
    "POSITIONS_FIELD",
    "ROUTED_EXPERTS",
    "INDEXER_TOPK",
    "ROUTING_CAPTURE",
    "INDEXER_CAPTURE",
    "argv_view",
    "tree_verify_refusal",
    "indexer_positions",
    "indexer_refusal",
    "capture_info",
    "capture_refusal",
]

REFUSED_FIELD = "capture_refused"  #: /rr/info: the refused kinds of rows, each with its one-line reason
POSITIONS_FIELD = "indexer_positions"  #: /rr/info: indexer picks are token positions (None: unknown, refused)
ROUTED_EXPERTS, INDEXER_TOPK = "routed_experts", "indexer_topk"  #: the kinds of rows a refusal names
# SGLang's server-args keys (and launch flags) that turn each capture on
ROUTING_CAPTURE = ("--enable-return-routed-experts", "enable_return_routed_experts")
INDEXER_CAPTURE = ("--enable-return-indexer-topk", "enable_return_indexer_topk")
# what a sample of each kind carries when refused: tree verification hands a token another draft node's rows (they
# come from another forward position than the sample's token); fused indexer picks are not positions
_ERRORS: dict[str, type[RoutedExpertsError]] = {ROUTED_EXPERTS: StaleRoutingError, INDEXER_TOPK: IndexerPositionError}


def _flag(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag`` on a launch line (``--flag value`` / ``--flag=value``; ``""`` when bare)."""
    found = None
    for i, a in enumerate(argv):
        name, eq, value = a.partition("=")
        if name == flag:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
    return found


def argv_view(engine: str, argv: Sequence[str]) -> dict[str, Any]:
    """The server-args keys :func:`capture_info` reads, as a launch line states them (what it leaves out stays out:
    a top-k SGLang chooses itself is only known once its arguments are resolved)."""
    view: dict[str, Any] = {}
    for flag, key in (ROUTING_CAPTURE, INDEXER_CAPTURE):
        value = _flag(argv, flag)
        view[key] = value is not None and value.lower() not in ("0", "false")
    tv = releases(engine).tree_verify
    if tv is not None:
        for flag, key in (tv.algorithm, tv.topk):
            if (value := _flag(argv, flag)) is not None:
                view[key] = value
    return view


def _facts(engine: str, version: str) -> ReleaseFacts | None:
    """The release's facts; None when its version cannot be parsed (every fact then unknown)."""
    try:
        return releases(engine).facts_for(version)
    except (UnsupportedVersionError, ConfigurationError, ValueError):
        return None


def _captures(server_args: Mapping[str, Any]) -> list[str]:
    """The capture flags a server runs with (launch-flag spelling)."""
    return [flag for flag, key in (ROUTING_CAPTURE, INDEXER_CAPTURE) if server_args.get(key)]


def _tree(tv: TreeVerify, server_args: Mapping[str, Any], resolved: bool) -> str | None:
    """The flags that make this server verify a draft tree (``--speculative-algorithm NGRAM``, or a top-k > 1), else
    None; an algorithm whose resolved top-k is missing or unreadable counts as a tree (unknown, never assumed)."""
    algo = str(server_args.get(tv.algorithm[1]) or "").upper()
    if algo in ("", "NONE"):
        return None
    if algo in tv.always_tree:
        return f"{tv.algorithm[0]} {algo}"
    topk = server_args.get(tv.topk[1])
    try:
        k = None if topk is None else int(topk)
    except (TypeError, ValueError):
        k = None
    if k is None and not resolved:
        return None  # SGLang chooses it while resolving its arguments: checked again then
    if k is not None and k <= 1:
        return None
    return f"{tv.algorithm[0]} {algo} {tv.topk[0]} {topk if k is None else k}"


def tree_verify_refusal(engine: str, version: str, server_args: Mapping[str, Any], *, resolved: bool) -> str | None:
    """The one-line refusal of a server that captures rows and verifies a draft tree on a release whose tree
    verification does not move the capture rows with the KV (or was not read), else None.

    ``server_args``: the server's arguments by key (:func:`argv_view` of a launch line, ``resolved=False``; SGLang's
    resolved server args or ``/get_server_info``, ``resolved=True``)."""
    rel = releases(engine)
    tv = rel.tree_verify
    captures = _captures(server_args)
    if tv is None or not captures or (tree := _tree(tv, server_args, resolved)) is None:
        return None
    facts = _facts(engine, version)
    moves = facts.tree_verify_moves_rows if facts is not None else None
    if moves:
        return None
    what = ", ".join(captures)
    if moves is None:
        return (
            f"{rel.wire.label} {version} with {tree} and {what}: rr has not read whether this release's speculative "
            f"tree verification moves the capture rows with the accepted tokens' KV (0.5.23's does not, {tv.issue}), "
            f"so it is refused; serve EAGLE/MTP with {tv.topk[0]} 1, or without speculative decoding"
        )
    dropped = " (and NGRAM's worker drops the target's capture output)" if "NGRAM" in tree.upper() else ""
    return (
        f"{rel.wire.label} {version} with {tree} and {what}: tree verification moves the accepted tokens' KV but not "
        f"their capture rows{dropped}, so tokens carry another draft node's rows, silently ({tv.issue}); serve "
        f"EAGLE/MTP with {tv.topk[0]} 1, or without speculative decoding"
    )


def indexer_positions(engine: str, version: str, fused: bool | None) -> bool | None:
    """Whether indexer picks captured with the fused top-k ``fused`` (None: unknown) are token positions; None when
    the fused setting or the release's fact is unknown."""
    facts = _facts(engine, version)
    only_unfused = facts.indexer_positions_unfused_only if facts is not None else None
    if only_unfused is None or fused is None:
        return None
    return not (only_unfused and fused)


def indexer_refusal(engine: str, version: str, server_args: Mapping[str, Any], fused: bool | None) -> str | None:
    """The one-line refusal of indexer capture whose picks are not (or not known to be) token positions, else None."""
    if not server_args.get(INDEXER_CAPTURE[1]) or indexer_positions(engine, version, fused):
        return None
    from rr_server.serving.engines.sglang import FUSE_TOPK_ENV

    label, flag = releases(engine).wire.label, INDEXER_CAPTURE[0]
    facts = _facts(engine, version)
    if facts is None or facts.indexer_positions_unfused_only is None:
        return (
            f"{label} {version} with {flag}: rr has not read whether this release captures the indexer top-k as token "
            "positions (0.5.23 does only with its fused top-k off); serve indexer replay on SGLang 0.5.23"
        )
    if fused is None:
        return (
            f"{label} {version} with {flag}: whether the server runs with {FUSE_TOPK_ENV} on cannot be seen (its "
            "server info does not say), and with it on (the default) the captured picks are KV slots, not positions; "
            "serve indexer replay through rr's patch (rr-server launch sglang turns it off and says so in /rr/info)"
        )
    return (
        f"{label} {version} with {flag} and {FUSE_TOPK_ENV} on (SGLang's default): the captured indexer top-k is the "
        "fused transform's output, KV slots (paged) or ragged offsets (fp8 cache), not token positions "
        f"(layers/attention/dsa/dsa_topk_backend.py topk_transform); set {FUSE_TOPK_ENV}=0 (rr-server launch sglang "
        "does)"
    )


def capture_info(
    engine: str, version: str, server_args: Mapping[str, Any] | None, *, fused: bool | None
) -> dict[str, Any]:
    """The ``/rr/info`` entries of a server's capture paths: :data:`POSITIONS_FIELD` and :data:`REFUSED_FIELD` (None when
    nothing is refused; ``server_args``: resolved, by key, None when they cannot be read; ``fused``: its ``SGLANG_DSA_FUSE_TOPK``, None
    when it cannot be seen). Unreadable arguments refuse the indexer picks (unknown); routing keeps the rows' checks."""
    if server_args is None:
        why = f"{releases(engine).wire.label} {version}: its server info cannot be read, so whether its indexer picks are "
        why += "positions cannot be told; serve indexer replay through rr's patch (rr-server launch sglang)"
        return {POSITIONS_FIELD: None, REFUSED_FIELD: {INDEXER_TOPK: why}}
    refused = {
        kind: why
        for kind, why in (
            (ROUTED_EXPERTS, tree_verify_refusal(engine, version, server_args, resolved=True)),
            (INDEXER_TOPK, indexer_refusal(engine, version, server_args, fused)),
        )
        if why
    }
    if refused.get(ROUTED_EXPERTS) and server_args.get(INDEXER_CAPTURE[1]):
        refused.setdefault(INDEXER_TOPK, refused[ROUTED_EXPERTS])  # the draft tree moves no indexer row either
    return {POSITIONS_FIELD: indexer_positions(engine, version, fused), REFUSED_FIELD: refused or None}


def capture_refusal(info: RRInfo | None, kind: str) -> RoutedExpertsError | None:
    """The typed error every sample of ``kind`` (:data:`ROUTED_EXPERTS` / :data:`INDEXER_TOPK`) carries on a server
    whose ``/rr/info`` refuses it, else None."""
    refused = (info.model_extra or {}).get(REFUSED_FIELD) if info is not None else None
    why = refused.get(kind) if isinstance(refused, Mapping) else None
    return _ERRORS[kind](str(why)) if why else None
