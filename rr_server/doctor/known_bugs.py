"""Known routing bugs by engine version, and whether rr covers each on a given deployment (docs/engines.md).

Which releases have a bug is never written here: each entry names a fact of
:mod:`rr_server.serving.engines` (one module per engine), the one place per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from rr_client.core.errors import ConfigurationError, UnsupportedVersionError
from rr_server.serving.engines import ReleaseFacts, releases

__all__ = ["KnownBug", "BugStatus", "known_bugs_for"]


@dataclass(frozen=True)
class KnownBug:
    """One upstream bug: which releases have it, where it was published, what rr does about it per deployment kind."""

    engine: str
    fact: str  # the boolean attribute of the engine's version facts that says a release has it
    what: str
    source: str  # the upstream issue / PR (or "found by rr") where it is published
    patched: str  # what the rr-patched engine does about it
    sidecar: str  # what the sidecar does about it
    unpatched: str  # what a doctor run against the bare engine can say
    platform: str | None = None  # only on this platform (/rr/info ``platform``): "npu" = vllm-ascend


@dataclass(frozen=True)
class BugStatus:
    """A known bug that applies to this deployment, with rr's coverage in words and its upstream source."""

    what: str
    coverage: str
    source: str = ""


_ZEROS_SIDECAR = "covered: the full check refuses all-zero MoE rows (the sample carries routed_experts_error)"
_ZEROS_UNPATCHED = "detected: the full check refuses all-zero MoE rows"
_TRUTH_ONLY = "not detected by the full check (ids in range): only ground truth (--model-path) shows it"
_DRAFT_SIDECAR = (
    "not covered: the rows keep their shape and id range; the doctor's ground truth (--model-path) "
    "against this deployment, with its own speculative settings, shows it"
)

_BUGS = (
    KnownBug(
        "vllm",
        "eplb_physical_ids",
        "captures physical expert ids after the EPLB remap (0.14-0.15)",
        "vLLM capture PR #28284 (0.14); docs/engines.md",
        "rr refuses vLLM < 0.22",
        "not covered: the ids are in range, only ground truth shows it",
        _TRUTH_ONLY,
    ),
    KnownBug(
        "vllm",
        "all_zero_routing",
        "returns all-zero routing (0.15; fixed by PR #33013 in 0.16)",
        "vllm-project/vllm PR #33013",
        "rr refuses vLLM < 0.22",
        _ZEROS_SIDECAR,
        _ZEROS_UNPATCHED,
    ),
    KnownBug(
        "vllm",
        "nested_json_lists",
        "sends nested JSON lists (~40 MB per 30k-token sample)",
        "vLLM 0.21 HTTP output; docs/engines.md",
        "rr refuses vLLM 0.21",
        "covered: decoded and re-encoded as uint8 .npy",
        "decoded by the client",
    ),
    KnownBug(
        "vllm",
        "fused_moe_zero_routing",
        "FlashInfer monolithic MoE kernels (the Blackwell default) return all-zero routing (fixed in 0.30)",
        "vllm-project/vllm#44116, #44214 (0.26 lacks the fix: #54730)",
        "covered: the full check refuses all-zero MoE rows (the sample carries routed_experts_error)",
        _ZEROS_SIDECAR,
        _ZEROS_UNPATCHED,
    ),
    KnownBug(
        "vllm",
        "draft_pollutes_routing",
        "speculative decoding: draft (MTP/EAGLE) MoE layers overwrite the target's rows, silently "
        f"(fixed in {releases('vllm').draft_fix_release})",
        releases("vllm").draft_issue,
        "covered: rr-server launch vllm refuses --speculative-* on this version",
        _DRAFT_SIDECAR,
        _TRUTH_ONLY,
    ),
    KnownBug(
        "vllm",
        "cpu_compile_zeros",
        "on CPU, torch.compile returns all-zero routing with the right shape",
        "found by rr (no upstream issue); docs/engines.md",
        "covered: the launcher forces --enforce-eager on CPU and the full check refuses all-zero rows",
        _ZEROS_SIDECAR,
        _ZEROS_UNPATCHED,
        platform="cpu",
    ),
    KnownBug(
        "vllm",
        "cpu_reload_unpacked_experts",
        "on CPU, reload_weights (weight sync) leaves the MoE experts' weights unpacked: the engine then serves "
        "wrong experts and wrong routing, with only a log warning ('weights were not loaded')",
        "found by rr (no upstream issue); docs/trainer.md",
        "covered: the plugin re-runs the CPU experts' prepack after every reload",
        "not covered: the sidecar cannot reach the engine's weights",
        "not detected here: rr's trainer weight sync checks the engine's log-probs after each sync",
        platform="cpu",
    ),
    KnownBug(
        "vllm",
        "always",
        "vllm-ascend: fused MoE returns all-zero routing",
        "vllm-project/vllm-ascend#16314",
        "covered: the full check refuses all-zero MoE rows",
        _ZEROS_SIDECAR,
        _ZEROS_UNPATCHED,
        platform="npu",
    ),
    KnownBug(
        "vllm",
        "always",
        "vllm-ascend: captures physical expert ids (after the log2phy remap)",
        "vllm-project/vllm-ascend#13882",
        "not covered: the ids are in range; only ground truth (--model-path) shows it",
        "not covered: the ids are in range, only ground truth shows it",
        _TRUTH_ONLY,
        platform="npu",
    ),
    KnownBug(
        "sglang",
        "tensor_lost_as_json",
        "with --skip-tokenizer-init the raw tensor is JSON-encoded as {} (routing lost; 0.5.7-0.5.9)",
        "SGLang 0.5.7-0.5.9 (fixed by the detokenizer encoding, PR #24263); docs/engines.md",
        "covered: the patch encodes the tensor before FastAPI sees it",
        "not recoverable: the data is lost upstream; refused as MissingRoutingError, never passed on",
        "detected: refused as MissingRoutingError",
    ),
    KnownBug(
        "sglang",
        "mixed_batch_bug",
        "in a batch where only some requests ask, one request can receive another's rows (fixed in 0.5.13)",
        "sgl-project/sglang PR #26423",
        "covered: the patch asks for routing on every request",
        "covered: the sidecar asks on every request",
        "exposed: the mixed-batch check below tests it",
    ),
    KnownBug(
        "sglang",
        "ignores_start",
        "routed_experts_start_len is accepted but ignored (0.5.8-0.5.11)",
        "SGLang 0.5.8-0.5.11; docs/engines.md",
        "covered: the patch slices the rows itself",
        "covered: the sidecar slices the rows itself",
        "exposed: the start check below tests it",
    ),
    KnownBug(
        "sglang",
        "drops_last_prompt_row",
        "max_new_tokens=0 loses the last prompt row",
        "sgl-project/sglang#20964",
        "refused: the row count check fails, never shifted",
        "refused: the row count check fails",
        "refused by the client's row count check",
    ),
    KnownBug(
        "sglang",
        "draft_pollutes_routing",
        "speculative decoding: draft MoE layers write the target's rows, silently (opt-out from "
        f"{releases('sglang').draft_fix_release})",
        releases("sglang").draft_issue,
        "covered: rr-server launch sglang refuses --speculative-* on this version",
        _DRAFT_SIDECAR,
        _TRUTH_ONLY,
    ),
    KnownBug(
        "sglang",
        "hash_layers_uncaptured",
        "DeepSeek-V4: hash-routed MoE layers (HashTopK) never write the capture buffer: all-zero rows there",
        "sgl-project/sglang#29040 (capture PR #29588 closed)",
        "covered: /rr/info states them in uncaptured_layers; the full check expects their zero rows exactly "
        "there (and refuses zero rows in every captured layer); replay leaves them to the model",
        "covered: the sidecar's /rr/info states them in uncaptured_layers; the full check expects zeros there",
        "covered: checked through the in-process sidecar, which knows the uncaptured layers",
    ),
)


def _facts(engine: str, version: str) -> ReleaseFacts:
    """The engine's version facts (ValueError for an unknown engine or unparsable version)."""
    try:
        return releases(engine).facts_for(version)
    except UnsupportedVersionError as e:
        raise ValueError(str(e)) from None
    except ConfigurationError:
        raise ValueError(f"unknown engine {engine!r}") from None


def known_bugs_for(engine: str, version: str, *, deployment: str, platform: str | None = None) -> list[BugStatus]:
    """Bugs of ``engine`` ``version`` with rr's coverage for ``deployment`` in patched|sidecar|unpatched.

    ``platform`` (``/rr/info``'s, e.g. cpu, cuda, npu): platform-specific bugs apply only there; when the server does
    not say (the sidecar, older rr), they are listed with "if on <platform>".
    """
    try:
        facts = _facts(engine, version)
    except ValueError:
        return [BugStatus(f"unknown {engine} version {version!r}", "cannot tell which known bugs apply")]
    out = []
    for bug in _BUGS:
        if bug.engine != engine or not (bug.fact == "always" or getattr(facts, bug.fact)):
            continue
        coverage = getattr(bug, deployment)
        if bug.platform is not None and platform is not None and bug.platform != platform:
            continue
        if bug.platform is not None and platform is None:
            coverage = f"if on {_PLATFORM_NAMES.get(bug.platform, bug.platform)} (the server does not say): {coverage}"
        out.append(BugStatus(bug.what, coverage, bug.source))
    return out


_PLATFORM_NAMES = {"npu": "Ascend NPU (vllm-ascend)", "cpu": "CPU"}
