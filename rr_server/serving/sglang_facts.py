"""Which SGLang releases rr knows, and what each one does with routing: the one place for SGLang's version facts.

The patch, the launcher, the sidecar and the doctor read these facts; none of them compares versions itself.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass

from rr_client.core.errors import UnsupportedVersionError
from rr_client.core.logprobs import PROCESSED, RAW
from rr_client.core.versions import Tested, check_version
from rr_server.serving.release import parse_release

__all__ = ["MIN_VERSION", "MAX_VERSION", "TESTED", "DRAFT_FIX_RELEASE", "Profile", "UnsupportedSGLangError",
           "installed_version", "profile_for", "facts_for", "ORIGINAL_LOGPROB_ENV", "logprobs_mode"]

# The SGLang releases rr's patch was tested on, each bound compared at patch precision.
TESTED = Tested("0.5.7", "0.5.23")
MIN_VERSION = parse_release(TESTED.lo)
MAX_VERSION = parse_release(TESTED.hi or TESTED.lo)


class UnsupportedSGLangError(UnsupportedVersionError):
    """The installed SGLang is outside the tested range, or its code no longer has the shape rr wraps."""


@dataclass(frozen=True)
class Profile:
    """Per-version facts the patch relies on (see docs: engines.md, SGLang section)."""

    version: str
    release: tuple[int, int, int]
    field: str  # BatchTokenIDOutput/BatchStrOutput attribute carrying routing
    handle_is_async: bool  # TokenizerManager._handle_batch_output is ``async def`` (0.5.11+)
    has_plugins: bool  # sglang.srt.plugins + HookRegistry exist (0.5.11+)
    honours_start: bool  # the scheduler slices rows from routed_experts_start_len (0.5.12+)
    has_start_field: bool  # GenerateReqInput.routed_experts_start_len exists (0.5.8+)
    mixed_batch_bug: bool  # scheduler list misaligned when only some requests ask (<= 0.5.12)
    detok_encodes: bool = False  # plugins load in the detokenizer, which base64-encodes routing (0.5.22+)
    tensor_lost_as_json: bool = False  # --skip-tokenizer-init JSON-encodes the raw tensor as {} (0.5.7-0.5.9)
    drops_last_prompt_row: bool = False  # max_new_tokens=0 loses the last prompt row (#20964, every release)
    draft_pollutes_routing: bool = False  # speculative draft MoE layers write the target's rows (#26980, < 0.5.23)
    hash_layers_uncaptured: bool = False  # HashTopK (DeepSeek-V4) layers never write the buffer: zero rows (0.5.23+)

    @property
    def ignores_start(self) -> bool:
        """``routed_experts_start_len`` is accepted but ignored (0.5.8-0.5.11): rr slices the rows itself."""
        return self.has_start_field and not self.honours_start

    @property
    def supported(self) -> bool:
        """Inside :data:`TESTED` (the version gate's own decision)."""
        return TESTED.covers(self.version)


def _release(version: str) -> tuple[int, int, int]:
    """The release tuple of ``version``; an unparsable string is an unsupported version."""
    try:
        return parse_release(version)
    except ValueError as e:
        raise UnsupportedSGLangError(f"cannot parse SGLang version {version!r}", package="sglang",
                                     version=str(version), tested=str(TESTED)) from e


def installed_version() -> str:
    """Version of the importable ``sglang`` (distribution metadata, else ``sglang.__version__``)."""
    try:
        import sglang

        return str(sglang.__version__)
    except (ImportError, AttributeError):
        return importlib.metadata.version("sglang")


def facts_for(version: str) -> Profile:
    """The facts of any parsable SGLang ``version`` (supported or not: the doctor reports bugs of both)."""
    rel = _release(version)
    return Profile(
        version=version,
        release=rel,
        field="output_routed_experts" if rel < (0, 5, 8) else "routed_experts",
        handle_is_async=rel >= (0, 5, 11),
        has_plugins=rel >= (0, 5, 11),
        honours_start=rel >= (0, 5, 12),
        has_start_field=rel >= (0, 5, 8),
        mixed_batch_bug=rel <= (0, 5, 12),
        detok_encodes=rel >= (0, 5, 22),
        tensor_lost_as_json=rel <= (0, 5, 9),
        drops_last_prompt_row=rel >= (0, 5, 7),
        draft_pollutes_routing=rel < (0, 5, 23),
        hash_layers_uncaptured=rel >= (0, 5, 23),
    )


# The first release with SGLang's draft opt-out (``disable_routed_experts_capture_for_draft``, #26980).
DRAFT_FIX_RELEASE = "0.5.23"


def profile_for(version: str | None = None) -> Profile:
    """The profile of ``version`` (default: installed); raises UnsupportedSGLangError outside :data:`TESTED`.

    The range decision is :func:`rr_client.core.versions.check_version`'s; SGLang's patch has no override (it never
    honoured ``RR_ALLOW_UNSUPPORTED_VERSION``): an untested SGLang is served through the rr sidecar instead.
    """
    version = installed_version() if version is None else version
    profile = facts_for(version)
    try:
        check_version("sglang", TESTED, version, allow_unsupported=False)
    except UnsupportedVersionError as e:
        raise UnsupportedSGLangError(
            f"rr's SGLang patch was tested with SGLang {TESTED}; found {version}. Refusing to patch code "
            "it was not tested against (pin a tested SGLang, or use the rr sidecar in front of it).",
            package=e.package, version=e.version, tested=e.tested) from None
    return profile


# SGLang's switch to pre-temperature sampled log-probs (its sampler, every release 0.5.7 - 0.5.23)
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def logprobs_mode(env: Mapping[str, str] | None = None) -> str:
    """What SGLang's sampled log-probs mean (0.5.7 - 0.5.23): after temperature (``log`` of the temperature-scaled
    softmax, before top-k/top-p/min-p), or before it when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is true (read as
    SGLang's ``get_bool_env_var`` reads it)."""
    value = (os.environ if env is None else env).get(ORIGINAL_LOGPROB_ENV, "false")
    return RAW if str(value).lower() in ("true", "1") else PROCESSED
