"""DeepSeek-V4.1's SWA bounded replay in vLLM and SGLang: which flag turns it on or off, from which release, and
the launchers' refusal (issue 44, docs/engines.md).

Bounded replay keeps the sliding-window KV out of prefix caching and, after a prefix hit, recomputes only the hit's
last window; the layers past the last KV-source layer then prefill only each request's trailing window. The log-probs
are not those of a full prefill (vllm-project/vllm#56752; SGLang's own help tells RL users to turn it off), and the
routing rows of prompt positions those layers never ran are whatever the capture buffer held. It acts on
DeepSeek-V4.1 only (``model_type`` ``deepseek_v41``), where both engines turn it on by default:

- vLLM 0.31+: ``CacheConfig.swa_bounded_replay = True`` (``--swa-bounded-replay`` / ``--no-swa-bounded-replay``;
  0.31 replays prefix hits, 0.32+ also trims the late layers); ``/metrics`` ``vllm:cache_config_info`` has it as a
  label.
- SGLang 0.5.21 - 0.5.22: ``--enable-decoder-swa-bounded-replay`` and ``--enable-encoder-swa-bounded-replay``, both
  opt-in. 0.5.23+: the decoder side resolves on for DeepSeek-V4.1 on CUDA/ROCm unless
  ``--no-enable-decoder-swa-bounded-replay``; the encoder side stays opt-in. ``/get_server_info`` reports both.

Which release has the switch, and where it is on by default, are release facts
(:class:`rr_server.serving.engines.ReleaseFacts` ``bounded_replay`` / ``bounded_replay_default_on``); the flags are
each engine's :class:`rr_server.serving.engines.base.ReplayFlags`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rr_client.core.errors import ConfigurationError, UnsupportedVersionError
from rr_server.serving.engines import RELEASES
from rr_server.serving.engines.base import ReplayFlags

__all__ = [
    "ALLOW_FLAG",
    "BOUNDED_REPLAY_MODEL_TYPES",
    "ReplayFlags",
    "REPLAY_FLAGS",
    "is_bounded_replay_model",
    "served_model",
    "model_config_of",
    "replay_in_argv",
    "check_bounded_replay",
    "off_advice",
]

# rr's own launcher flag (taken out before the engine parses): start with bounded replay on anyway
ALLOW_FLAG = "--rr-allow-bounded-replay"
BOUNDED_REPLAY_MODEL_TYPES = frozenset({"deepseek_v41"})
_ARCHITECTURES = frozenset({"DeepseekV41ForCausalLM"})
_NAME = re.compile(r"deepseek[-_ ]?v4[._-]?1(?!\d)", re.I)


REPLAY_FLAGS: Mapping[str, ReplayFlags] = {
    name: r.bounded_replay_flags for name, r in RELEASES.items() if r.bounded_replay_flags is not None
}  # each engine's switch, from its release facts (rr_server.serving.engines)


def off_advice(engine: str) -> str:
    """How to turn bounded replay off on ``engine``, in words (the flag to pass, the one to leave out)."""
    flags = REPLAY_FLAGS.get(engine)
    if flags is None:
        return "serve without SWA bounded replay"
    advice = f"start the engine with {flags.off}"
    if flags.opt_in:
        advice += " and without " + ", ".join(flags.opt_in)
    return advice


def is_bounded_replay_model(cfg: Mapping[str, Any]) -> bool:
    """The HF config is a model the engines bound-replay (DeepSeek-V4.1: ``model_type`` or ``architectures``)."""
    for c in (cfg, cfg.get("text_config")):
        if not isinstance(c, Mapping):
            continue
        if c.get("model_type") in BOUNDED_REPLAY_MODEL_TYPES:
            return True
        archs = c.get("architectures")
        if isinstance(archs, list) and _ARCHITECTURES & {str(a) for a in archs}:
            return True
    return False


def model_config_of(model: str) -> dict[str, Any] | None:
    """The ``config.json`` of ``model`` (a checkpoint folder, or a hub id already in the local Hugging Face cache;
    never downloaded); None when there is none to read."""
    path: Path | None = Path(model) / "config.json" if Path(model).is_dir() else None
    if path is None and re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        found = try_to_load_from_cache(model, "config.json")
        path = Path(found) if isinstance(found, str) else None
    if path is None or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _last_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last ``--name V`` / ``--name=V`` among ``names`` (argparse keeps the last)."""
    found = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def served_model(engine: str, argv: Sequence[str]) -> str | None:
    """The model ``argv`` serves: the engine's model flags (vLLM ``--model``, SGLang ``--model-path``), or vLLM
    ``serve``'s positional tag (:class:`rr_client.core.engines.Engine` ``model_flags`` / ``positional_model``)."""
    eng = RELEASES[engine].wire
    model = _last_value(argv, [s for n in eng.model_flags for s in _spellings(n)])
    if model is None and eng.positional_model and argv and not argv[0].startswith("-"):
        model = argv[0]
    return model


def _spellings(flag: str) -> tuple[str, str]:
    return flag, "--" + flag[2:].replace("-", "_")


def _switch(args: Sequence[str], on: str, off: str) -> bool | None:
    """The last of ``on`` / ``off`` in ``args`` (both spellings; ``on=false`` counts as off); None: neither."""
    state = None
    for a in args:
        name, eq, value = a.partition("=")
        if name in _spellings(on):
            state = not (eq and value.lower() in ("0", "false", "no"))
        elif name in _spellings(off):
            state = False
    return state


def replay_in_argv(engine: str, version: str, argv: Sequence[str]) -> list[str]:
    """The bounded-replay switches that would be on with ``argv`` on ``engine`` ``version`` (the flag that
    set each, or "default"); empty when none (or the release has none)."""
    flags = REPLAY_FLAGS.get(engine)
    if flags is None:
        return []
    try:
        facts = RELEASES[engine].facts_for(version)
    except UnsupportedVersionError:  # an unparsable release: the version gate speaks for it
        return []
    if not facts.bounded_replay:
        return []
    on: list[str] = []
    given = _switch(argv, flags.on, flags.off)
    if given or (given is None and facts.bounded_replay_default_on):
        on.append(flags.on if given else f"{flags.on} (the default of {engine} {version})")
    on += [f for f in flags.opt_in if _switch(argv, f, "--no-" + f[2:])]
    return on


def check_bounded_replay(engine: str, version: str, argv: Sequence[str], *, allow: bool = False) -> str | None:
    """ConfigurationError when ``argv`` serves a DeepSeek-V4.1 model with bounded replay on (unless ``allow``); the
    warning to log when it is allowed, or when the model's config cannot be read; None when nothing is on."""
    on = replay_in_argv(engine, version, argv)
    if not on:
        return None
    model = served_model(engine, argv) or ""
    cfg = model_config_of(model) if model else None
    known = is_bounded_replay_model(cfg) if cfg is not None else None
    if known is False:
        return None  # the engines bound-replay DeepSeek-V4.1 only
    what = (
        f"{engine} {version} serves {model or 'the model'} with DeepSeek-V4.1 SWA bounded replay on "
        f"({', '.join(on)}): a prefix hit recomputes only the last window and the late layers prefill only each "
        "request's trailing window, so the log-probs differ from a trainer's full prefill and the routing rows "
        "of prompt positions those layers never ran are unverified"
    )
    if known is None and not _NAME.search(model):
        return (
            f"rr: cannot read {model or 'the model'}'s config.json to tell whether it is DeepSeek-V4.1; if it is, "
            f"{what}. To train on its rollouts, {off_advice(engine)}"
        )
    if allow:
        return f"rr: {ALLOW_FLAG}: {what}. Replayed log-probs and prompt rows will not match a full prefill"
    raise ConfigurationError(f"{what}. To train on its rollouts, {off_advice(engine)}; or pass {ALLOW_FLAG}")
