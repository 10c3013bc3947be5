"""Every ``RR_*`` environment setting, and the one reader that parses them (one rule for every flag).

A flag is on for ``1``/``true``/``yes``/``on`` and off for ``0``/``false``/``no``/``off`` or unset/empty (any case,
surrounding spaces ignored); anything else raises :class:`SettingError` naming the variable, never a guess.
Lives in the light core (no torch, no httpx) because the client reads ``RR_API_KEY`` and servers read the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rr_client.core.errors import SettingError

__all__ = ["Setting", "SETTINGS", "SettingError", "flag", "text", "integer", "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Setting:
    """One ``RR_*`` variable: its name, kind (flag, text, int), what it does, and its value when unset (as
    docs/engines.md's table states it; a test keeps that table equal to this one)."""

    name: str
    kind: str
    doc: str
    default: str = "unset"


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("RR_ENABLE", "flag", "switches the rr vLLM plugin on (set by `rr-server launch vllm`)", "off"),
        Setting(
            "RR_TEST_FAULTS",
            "flag",
            "tests only: a request whose rid starts `rr-fault-<name>-` gets that engine fault in its rows (`rr_server.serving.test_faults`); never in production",
            "off",
        ),
        Setting(
            "RR_ALLOW_UNSUPPORTED_VERSION",
            "flag",
            "the one override of the version gates (`rr_client.core.versions.check_version`) of the vLLM plugin and launcher and of rr's TRL, verl and Megatron-core integrations: an untested vLLM, TRL, verl or megatron-core release is tried instead of refused (SGLang's patch refuses untested releases: use the sidecar)",
            "off",
        ),
        Setting(
            "RR_AUDIT_EVERY", "int", "verl: steps between audited replay steps (the first step always; 0 = never)", "10"
        ),
        Setting(
            "RR_STALE_ROWS",
            "text",
            "verl: the stale-rows policy on each sample's provenance in verl's batch (refuse, mask or off)",
            "refuse",
        ),
        Setting(
            "RR_ALLOW_UNTESTED_MODEL",
            "flag",
            "verl: replay a MoE family whose router formula is in rr but untested",
            "off",
        ),
        Setting(
            "RR_VLLM_ALWAYS_RETURN_ROUTED_EXPERTS",
            "flag",
            "patched vLLM: every /generate answer carries routing",
            "off",
        ),
        Setting(
            "RR_SGLANG_ALWAYS_RETURN_ROUTED_EXPERTS", "flag", "patched SGLang: every answer carries routing", "off"
        ),
        Setting(
            "RR_INDEXER_TOPK_FORMAT",
            "text",
            "server default `indexer_topk_format`: `ref` (by reference) or `npy` (inline)",
            "ref",
        ),
        Setting(
            "RR_ROUTED_EXPERTS_FORMAT",
            "text",
            "server default `routed_experts_format`: `npy`, `sglang` or `ref`",
            "npy",
        ),
        Setting(
            "RR_ROUTING_STORE",
            "text",
            "rr servers: where rows for refs are held: `memory` (in the server), `ray` (Ray's object store, one store actor per engine process; `rr-replay[ray]`), or an object store URL (`s3://bucket/prefix`, `file:///shared/path`: refs outlive the engine; `rr-replay[objects]`; `--rr-store`)",
            "memory",
        ),
        Setting(
            "RR_OBJECT_STORE_WRITERS",
            "int",
            "rr servers with an object store: object writes in flight at once (per API server process)",
            "8",
        ),
        Setting(
            "RR_OBJECT_STORE_PENDING_BYTES",
            "int",
            "rr servers with an object store: bytes of objects being written at once; a sample past it waits for room (backpressure)",
            "268435456 (256 MiB)",
        ),
        Setting(
            "RR_OBJECT_STORE_WRITE_TIMEOUT",
            "int",
            "rr servers with an object store: seconds a sample's write (and its wait for room) may take before that sample is refused (`RoutingStoreWriteError`)",
            "60",
        ),
        Setting(
            "RR_OBJECT_STORE_MAX_AGE",
            "int",
            "rr servers with an object store: seconds an object is kept before the store deletes it (the lifetime bound; retire deletes sooner)",
            "604800 (7 days)",
        ),
        Setting(
            "RR_OBJECT_STORE_MAX_OBJECTS",
            "int",
            "rr servers with an object store: objects kept under the URL at most (the oldest deleted first, counting an earlier run's)",
            "1000000",
        ),
        Setting(
            "RR_ROUTING_STORE_BYTES",
            "int",
            "rr servers: byte cap of the routing store that holds rows for refs (oldest evicted first; per API server process)",
            "2147483648 (2 GiB)",
        ),
        Setting(
            "RR_INDEXER_STORE_BYTES",
            "int",
            "rr's SGLang patch and the sidecar: byte cap of the indexer store that holds sparse-attention indexer rows for refs, apart from the routing store (oldest evicted first; neither kind evicts the other)",
            "2147483648 (2 GiB)",
        ),
        Setting(
            "RR_ROUTING_READ_BYTES",
            "int",
            "rr servers: most bytes of rows one `POST /rr/routing/read` answers, and hashes for row ranges (counted before any row is read, each stored row once; more answer 413 naming the count and the cap; rr_client splits its reads under it)",
            "134217728 (128 MiB)",
        ),
        Setting(
            "RR_ADVERTISE_URL",
            "text",
            "rr servers: the URL a routing ref names for reading its rows",
            "the server's own host and port",
        ),
        Setting(
            "RR_RAY_ADDRESS", "text", "the Ray cluster the Ray routing store and `ray://` ref readers join", "auto"
        ),
        Setting(
            "RR_ENCODE_THREAD_MIN_ELEMS",
            "int",
            "patched vLLM: encode routing off the event loop above this many elements",
            "1048576",
        ),
        Setting(
            "RR_API_KEY",
            "text",
            "client, doctor and weight sync: the key sent as `Authorization: Bearer`; sidecar: a key it requires (with `--api-key`)",
        ),
        Setting("RR_UPSTREAM_API_KEY", "text", "sidecar: the key sent to the engine (its `--api-key`)"),
        Setting(
            "RR_TRUSTED_HOSTS",
            "text",
            "client: comma-separated `host` or `host:port` a routing ref may name and that get its key (besides its replicas; `trusted_hosts=`)",
        ),
        Setting(
            "RR_OBJECT_STORES",
            "text",
            "client: comma-separated object store URL prefixes (`s3://bucket/prefix`, `file:///path`) a routing ref may name; read with the client's own fsspec credentials (`object_stores=`)",
        ),
        Setting(
            "RR_KEYLESS_HOSTS",
            "text",
            "client: comma-separated `host` or `host:port` a routing ref may name, read without the key (`keyless_hosts=`)",
        ),
    )
}


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    """The variable's value, stripped; refuses names that are not registered (a typo is a bug, not a default)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not an rr setting (known: {', '.join(sorted(SETTINGS))})")
    return (os.environ if env is None else env).get(name, "").strip()


def flag(name: str, env: Mapping[str, str] | None = None, *, default: bool = False) -> bool:
    """A flag setting: on/off by the module's one rule; ``default`` when unset or empty."""
    value = _raw(name, env).lower()
    if not value:
        return default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise SettingError(f"{name}={value!r} is not a flag: use one of {sorted(TRUE_WORDS | FALSE_WORDS)}")


def text(name: str, env: Mapping[str, str] | None = None, *, default: str | None = None) -> str | None:
    """A text setting; ``default`` when unset or empty."""
    return _raw(name, env) or default


def integer(name: str, env: Mapping[str, str] | None = None, *, default: int) -> int:
    """An integer setting; ``default`` when unset or empty; SettingError on anything else."""
    value = _raw(name, env)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SettingError(f"{name}={value!r} is not an integer") from None
