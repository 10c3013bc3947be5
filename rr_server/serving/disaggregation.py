"""Prefill/decode disaggregation and routing: which KV connectors a vLLM launch line turns on, and the refusal on
releases that cannot return routed experts with them; the same for SGLang's ``--disaggregation-mode`` (docs/scale-out.md,
"Prefill/decode disaggregation").

SGLang's prefill server gathers the prompt's rows (when its KV transfer ends) from 0.5.22 on; before, it answers none
(``[]`` on 0.5.7-0.5.9, no key after), so no sample of a pair can be whole: rr refuses either role there.

vLLM 0.30 refuses any KV connector together with ``--enable-return-routed-experts`` (P/D and offload alike:
"incompatible with KV connectors"); 0.31-0.33 refuse the P/D connectors (Nixl, NixlPull, NixlPush, MoRIIO, Mooncake,
directly or inside a MultiConnector: "PD auxiliary output is not supported"). Either way the engine stops deep in its
config check; rr's launcher refuses first, naming the connector, the release's rule and where P/D with routing runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rr_server.serving.engines import releases

__all__ = [
    "kv_transfer_config",
    "kv_connectors",
    "pd_refusal",
    "disaggregation_mode",
    "sglang_pd_refusal",
    "upstream_role_refusal",
]

_FLAGS = ("--kv-transfer-config", "--kv_transfer_config")
_MODE_FLAGS = ("--disaggregation-mode", "--disaggregation_mode")


def _flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the last of ``flags`` on a launch line (``--flag value`` or ``--flag=value``)."""
    found = None
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in flags:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return found


def disaggregation_mode(argv: Sequence[str]) -> str | None:
    """SGLang's ``--disaggregation-mode`` on a launch line: "prefill" or "decode"; None for "null" or absent."""
    mode = _flag_value(argv, _MODE_FLAGS)
    return mode if mode in ("prefill", "decode") else None


def sglang_pd_refusal(version: str, argv: Sequence[str]) -> str | None:
    """The launcher's refusal of ``--disaggregation-mode prefill|decode`` on a SGLang release whose prefill server
    returns no routing."""
    mode = disaggregation_mode(argv)
    if mode is None or releases("sglang").facts_for(version).pd_prefill_rows:
        return None
    return (
        f"SGLang {version} with --disaggregation-mode {mode}: this release's prefill server returns no routed experts "
        "(it gathers the prompt's rows only from 0.5.22 on), and the decode server never ran the prompt, so no sample "
        "of the pair could carry its prompt's routing. Use SGLang 0.5.22+ for P/D with routing replay, or serve "
        "without --disaggregation-mode"
    )


def upstream_role_refusal(said: Any, role: str, url: str) -> str | None:
    """The sidecar's refusal of a SGLang upstream whose ``disaggregation_mode`` (``said``: its ``/get_model_info``'s
    or ``/get_server_info``'s; None when neither says) is not the ``role`` it is used in: ``"null"`` a plain sidecar's
    upstream, ``"prefill"`` / ``"decode"`` a P/D sidecar's. A P/D server (or a P/D router answering for one) behind a
    plain sidecar answers a decode server's prompt rows, its capture buffer's leftovers."""
    if said is None or said == role:
        return None
    if role == "null":
        return (
            f"the upstream {url} is a SGLang P/D server (disaggregation_mode={said!r}): a plain sidecar would pass on "
            "prompt rows its decode server never ran; serve the pair with --upstream DECODE_URL --prefill-upstream "
            "PREFILL_URL --bootstrap-port N (docs/scale-out.md)"
        )
    return (
        f"the {role} upstream {url} says disaggregation_mode={said!r}: --prefill-upstream takes the prefill server, "
        "--upstream the decode server"
    )


def kv_transfer_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` JSON of a vLLM launch line (both spellings, ``--flag=value`` too); None when absent
    or not a JSON object (vLLM then answers for it)."""
    text = _flag_value(argv, _FLAGS)
    if text is None:
        return None
    try:
        cfg = json.loads(text)
    except ValueError:
        return None
    return cfg if isinstance(cfg, dict) else None


def kv_connectors(cfg: dict[str, Any]) -> list[str]:
    """The connectors a KV-transfer config names: its own, and a MultiConnector's children."""
    own = cfg.get("kv_connector")
    names = [str(own)] if own else []
    if own == "MultiConnector":
        children = (cfg.get("kv_connector_extra_config") or {}).get("connectors") or []
        names += [str(c.get("kv_connector")) for c in children if isinstance(c, dict) and c.get("kv_connector")]
    return names


def pd_refusal(version: str, argv: Sequence[str]) -> str | None:
    """The launcher's refusal when ``argv`` turns on a KV connector this vLLM release cannot return routing with."""
    cfg = kv_transfer_config(argv)
    if cfg is None:
        return None
    names = kv_connectors(cfg)
    facts = releases("vllm").facts_for(version)
    where = (
        "prefill/decode disaggregation with routing replay runs on SGLang, whose prefill and decode servers each "
        "return the rows they computed and rr joins them at the seam (docs/scale-out.md)"
    )
    if facts.kv_connector_refused and names:
        return (
            f"vLLM {version} with --kv-transfer-config ({', '.join(names)}): this release refuses every KV connector "
            "(P/D and KV offload alike) together with --enable-return-routed-experts ('incompatible with KV "
            f"connectors'), so it would not start. Serve it without --kv-transfer-config; {where}"
        )
    bad = [n for n in names if n in facts.pd_connectors_refused]
    if bad:
        return (
            f"vLLM {version} with --kv-transfer-config ({', '.join(bad)}): this release cannot return routed experts "
            "across a P/D KV transfer ('PD auxiliary output is not supported'), so it would not start. Offload "
            f"connectors (OffloadingConnector, LMCache) are accepted; {where}"
        )
    return None
