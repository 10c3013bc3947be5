"""The names of every metric rr logs in a trainer: one module, so the audit, the session and each integration
write the same keys (a dashboard built on one trainer reads another). Torch-free.

Per-step keys (what :meth:`rr_client.trainer.ReplaySession.flush` returns, and TRL / verl log under their own
prefix) and per-layer keys (:func:`layer`, with ``log_layers=True``).
"""

from __future__ import annotations

from rr_client.core.source_audit import DEPTH_BUCKETS as _DEPTHS
from rr_client.core.source_audit import SEGMENTS as _SEGMENTS

__all__ = [
    "PREFIX",
    "FORWARDS",
    "MOE_LAYERS",
    "REPLAYED_ROWS",
    "LEFT_ROWS",
    "APPLIED_SHARE",
    "APPLIED_SHARE_MIN_LAYER",
    "AGREEMENT",
    "LEFT_LAYERS_HASH",
    "LEFT_ROUTERS_OUTSIDE_DECODER",
    "ORPHAN_ROUTERS",
    "UNCONSUMED_LAYERS",
    "AUDITED",
    "MEAN_ABS_LOGP_DIFF",
    "K3_KL",
    "FRAC_ABS_DIFF_GT_LN2",
    "LOGP_TOKENS",
    "WEIGHT_SYNC_SECONDS",
    "WEIGHT_SYNC_PROBE_GAP",
    "IS_RATIO_MIN",
    "IS_RATIO_MEAN",
    "IS_RATIO_MAX",
    "layer",
    "is_layer_key",
    "LAYER_SHARE_SUFFIXES",
    "STALE_MASKED",
    "SPANS_UPDATE",
    "PROVENANCE_UNKNOWN",
    "CACHED_TOKENS",
    "SOURCE_PREFIX",
    "SOURCE_CHECKED",
    "SOURCE_FLAGGED",
    "source",
    "DEPTH_BUCKETS",
    "depth",
    "is_depth_key",
    "SEGMENTS",
    "segment",
    "is_segment_key",
    "INDEXER_PREFIX",
    "INDEXER_LAYERS",
    "INDEXER_REPLAYED_ROWS",
    "INDEXER_APPLIED_SHARE",
    "INDEXER_AGREEMENT",
    "INDEXER_LEFT_LAYERS",
    "indexer_layer",
    "is_indexer_layer_key",
]

PREFIX = "r3/"

# the replay audit (one block; summed / worst-of over a step by the session)
FORWARDS = "r3/forwards"  #: forwards (and checkpoint recomputes) that ran replayed
MOE_LAYERS = "r3/moe_layers"  #: MoE routers rr replays in the model
REPLAYED_ROWS = "r3/replayed_rows"  #: (token, layer) rows forced to the rollout's experts
LEFT_ROWS = "r3/left_rows"  #: rows left to the model's own choice (mask False, pads)
APPLIED_SHARE = "r3/applied_share"  #: replayed rows whose experts received exactly the replayed ids (worst block)
APPLIED_SHARE_MIN_LAYER = "r3/applied_share_min_layer"  #: the worst layer's applied share
AGREEMENT = "r3/agreement"  #: replayed rows the trainer's own router chose too (row-weighted)
LEFT_LAYERS_HASH = "r3/left_layers_hash"  #: hash-routed layers (DeepSeek-V4) left to the model
LEFT_ROUTERS_OUTSIDE_DECODER = "r3/left_routers_outside_decoder"  #: MTP / tower routers left to the model
ORPHAN_ROUTERS = "r3/orphan_routers"  #: routers that never ran (the audit raises on them)
UNCONSUMED_LAYERS = "r3/unconsumed_layers"  #: layers of rows no router consumed (the audit raises on them)
AUDITED = "r3/audited"  #: 1 when this step's forwards ran under the audit (every ``audit_every``-th step)

# the log-prob gap between the trainer and the engine's sampling log-probs (token-weighted over a step)
MEAN_ABS_LOGP_DIFF = "r3/mean_abs_logp_diff"
K3_KL = "r3/k3_kl"
FRAC_ABS_DIFF_GT_LN2 = "r3/frac_abs_diff_gt_ln2"
LOGP_TOKENS = "r3/logp_tokens"  #: tokens the gap was measured on

# weight sync (TRL)
WEIGHT_SYNC_SECONDS = "r3/weight_sync_seconds"
WEIGHT_SYNC_PROBE_GAP = "r3/weight_sync_probe_gap"

# the importance-sampling correction with the engine's log-probs (TRL's own modes)
IS_RATIO_MIN = "r3/is_ratio_min"
IS_RATIO_MEAN = "r3/is_ratio_mean"
IS_RATIO_MAX = "r3/is_ratio_max"

# provenance (rr_client.core.provenance.check_provenance, summed over a step)
STALE_MASKED = "r3/stale_masked"  #: samples that may have been recomputed across a weight update, kept unreplayed
SPANS_UPDATE = "r3/spans_update"  #: samples that span a weight update without a recompute (kept, flagged)
PROVENANCE_UNKNOWN = "r3/provenance_unknown"  #: samples whose server gave no provenance
CACHED_TOKENS = "r3/cached_tokens"  #: prompt tokens served from the engine's prefix cache

# the source audit (rr_client.client.SourceAudit): the engine's re-score of served samples against their rows
SOURCE_PREFIX = "r3/source/"
SOURCE_CHECKED = "r3/source/checked"  #: samples re-scored this step
SOURCE_FLAGGED = "r3/source/flagged"  #: re-scored samples below the audit's threshold (refused or masked as stale)


def source(metric: str, part: str | None = None) -> str:
    """``r3/source/<metric>``, or ``r3/source/<part>/<metric>`` for a token segment (:data:`SEGMENTS`) or a depth
    bucket (``depth_0-8k`` .. ``depth_64k+``); metrics: ``agreement``, ``token_agreement``, ``cells``,
    ``worst_layer``, ``worst_layer_agreement``, ``checked``, ``flagged``, ``indexer_agreement`` (the indexer's picks)."""
    if part is not None and part not in SEGMENTS and part.removeprefix("depth_") not in DEPTH_BUCKETS:
        raise ValueError(f"source audit part {part!r}: expected a segment {SEGMENTS} or depth_<bucket>")
    return f"{SOURCE_PREFIX}{metric}" if part is None else f"{SOURCE_PREFIX}{part}/{metric}"


# sparse-attention indexer replay (rr_client.trainer.replay_indexer): its own keys, beside the experts'
INDEXER_PREFIX = "r3/indexer/"
INDEXER_LAYERS = "r3/indexer/layers"  #: indexers replayed in the model
INDEXER_REPLAYED_ROWS = "r3/indexer/replayed_rows"  #: (token, indexer layer) rows forced to the engine's positions
INDEXER_APPLIED_SHARE = "r3/indexer/applied_share"  #: replayed rows the attention received exactly (worst block)
INDEXER_AGREEMENT = "r3/indexer/agreement"  #: replayed rows the trainer's own indexer picked too (row-weighted)
#: a step that replayed routing without indexer picks in a model that has indexers: how many were left to their own
#: pick (a mismatch R3 of the experts alone does not remove)
INDEXER_LEFT_LAYERS = "r3/indexer/left_layers"

# the audit by token segment: agreement and log-prob gap of cached prompt, computed prompt and generated tokens
SEGMENTS = _SEGMENTS  # the source audit's too (rr_client.core.source_audit)
#: context-depth buckets (token position) of the gap, the replay agreement and the source audit
DEPTH_BUCKETS = _DEPTHS


def depth(bucket: str, metric: str) -> str:
    """``r3/depth/<bucket>/<metric>``: the log-prob gap (``mean_abs_logp_diff``, ``k3_kl``, ``logp_tokens``, ...) or
    the replay ``agreement`` of tokens at context depth ``bucket`` (one of :data:`DEPTH_BUCKETS`)."""
    if bucket not in DEPTH_BUCKETS:
        raise ValueError(f"depth bucket {bucket!r}: expected one of {DEPTH_BUCKETS}")
    return f"{PREFIX}depth/{bucket}/{metric}"


def is_depth_key(key: str) -> bool:
    """Whether ``key`` is a per-depth key (:func:`depth`)."""
    return key.startswith(PREFIX + "depth/")


def segment(name: str, metric: str, turn: int | None = None) -> str:
    """``r3/<segment>/<metric>`` (``r3/turn<t>/<segment>/<metric>`` for turn ``t`` of a trajectory); ``name`` one
    of :data:`SEGMENTS`, ``metric`` e.g. ``agreement``, ``mean_abs_logp_diff``, ``tokens``."""
    if name not in SEGMENTS:
        raise ValueError(f"segment {name!r}: expected one of {SEGMENTS}")
    return f"{PREFIX}{name}/{metric}" if turn is None else f"{PREFIX}turn{turn}/{name}/{metric}"


#: per-layer keys whose step value is the worst block's (the others are summed)
LAYER_SHARE_SUFFIXES = ("applied_share", "agreement")


def layer(index: int, name: str) -> str:
    """The per-layer key ``r3/layer<index>/<name>`` (``name``: replayed_rows, left_rows, applied_share, ...)."""
    return f"{PREFIX}layer{index}/{name}"


def indexer_layer(index: int, name: str) -> str:
    """The per-layer indexer key ``r3/indexer/layer<index>/<name>`` (replayed_rows, applied_share, agreement)."""
    return f"{INDEXER_PREFIX}layer{index}/{name}"


def is_layer_key(key: str) -> bool:
    """Whether ``key`` is a per-layer key."""
    return key.startswith(PREFIX + "layer")


def is_indexer_layer_key(key: str) -> bool:
    """Whether ``key`` is a per-layer indexer key (:func:`indexer_layer`)."""
    return key.startswith(INDEXER_PREFIX + "layer")


def is_segment_key(key: str) -> bool:
    """Whether ``key`` is a per-segment key (``r3/<segment>/...`` or ``r3/turn<t>/<segment>/...``)."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] + "/" != PREFIX:
        return False
    if parts[1].startswith("turn") and parts[1][4:].isdigit():
        return len(parts) >= 4 and parts[2] in SEGMENTS
    return parts[1] in SEGMENTS
