"""rr's per-TokenizerManager state: version profile, the served model's RRInfo, and which requests asked."""

from __future__ import annotations

import logging
from typing import Any

from rr_client.core.info import RRInfo
from rr_server.serving.capture_paths import POSITIONS_FIELD, REFUSED_FIELD, capture_info
from rr_server.serving.engines import ReleaseFacts
from rr_server.serving.engines.sglang import fuse_topk, logprobs_mode, profile_for
from rr_server.serving.weight_epoch import WeightEpoch, WeightMark

__all__ = ["RRState", "state_of", "rr_enabled"]

logger = logging.getLogger("rr.sglang")
_STATE_ATTR = "_rr_state"


class RRState:
    """What rr remembers per TokenizerManager; ``info`` is None when the model config gives no routing dims."""

    def __init__(self, profile: ReleaseFacts, info: RRInfo | None) -> None:
        self.profile = profile
        self.info = info
        self.asked: dict[str, tuple[bool, int, str | None]] = {}  # rid -> (asked, start, routed_experts_format)
        self.collectors: dict[str, Any] = {}  # rid -> the OpenAI request's Collector (rr_patches.sglang.openai)
        self.epoch = WeightEpoch()  # weight updates seen on SGLang's weight routes (/rr/info weight_version)
        self.admitted: dict[str, tuple[WeightMark, list[int] | None]] = {}  # rid -> (epoch at admission, prompt ids)
        self.indexer_format: dict[str, str | None] = {}  # rid -> indexer_topk_format, for requests asking the indexer


def _hf_config(tm: Any) -> dict[str, Any]:
    """The served model's HF config as a dict (SGLang's ModelConfig keeps it as ``hf_config``)."""
    cfg = tm.model_config.hf_config
    return dict(cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg))


def rr_enabled(tm: Any) -> bool:
    """rr acts only on servers started with ``--enable-return-routed-experts``."""
    return bool(getattr(tm.server_args, "enable_return_routed_experts", False))


def _server_args(sa: Any) -> dict[str, Any]:
    """SGLang's server args by key as the server runs them: 0.5.23's resolved view (``resolved_dict``: a draft top-k
    SGLang chose itself), the record's own fields before."""
    try:
        return dict(sa.resolved_dict()) if hasattr(sa, "resolved_dict") else dict(vars(sa))
    except Exception:  # noqa: BLE001 - an unresolvable record: its raw fields (a missing top-k is then refused)
        return dict(vars(sa))


def _fused() -> bool | None:
    """This serving process's ``SGLANG_DSA_FUSE_TOPK`` (its schedulers inherit it); None when SGLang could not read
    it either."""
    try:
        return fuse_topk()
    except ValueError:
        return None


def _info_for(tm: Any, profile: ReleaseFacts) -> RRInfo | None:
    """The served model's RRInfo, or None (logged) when its config has no routing dims."""
    sa = tm.server_args
    paths = capture_info(profile.engine, profile.version, _server_args(sa), fused=_fused())
    try:
        return RRInfo.from_hf_config(
            _hf_config(tm),
            engine="sglang",
            engine_version=profile.version,
            model=str(getattr(sa, "served_model_name", None) or sa.model_path),
            routing_enabled=rr_enabled(tm),
            skip_tokenizer_init=bool(getattr(sa, "skip_tokenizer_init", False)),
            platform=str(getattr(sa, "device", None) or "") or None,
            speculative=(str(sa.speculative_algorithm) if getattr(sa, "speculative_algorithm", None) else None),
            logprobs_mode=logprobs_mode(),
            # refused capture paths (speculative draft trees, fused indexer top-k): /rr/info and every sample
            capture_refused=paths[REFUSED_FIELD],
            indexer_positions=paths[POSITIONS_FIELD],
        )
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        logger.error("rr: cannot read routing dims from the model config (%s); routing will be refused", e)
        return None


def state_of(tm: Any) -> RRState:
    """The rr state of ``tm``, created on first use (the RRInfo is built once from the model config)."""
    st: RRState | None = getattr(tm, _STATE_ATTR, None)
    if st is None:
        profile = profile_for()
        st = RRState(profile, _info_for(tm, profile))
        setattr(tm, _STATE_ATTR, st)
    return st
