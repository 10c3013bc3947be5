"""Resolving ``ray://`` routing refs: the rows are objects in Ray's object store (the engine's one ``ray.put``),
held by the store actor of the engine that made them (rr_server.serving.store.ray); a trainer rank asks that actor
where they are and ``ray.get`` s them, checksumming what arrived.
Needs ``rr-replay[ray]`` and a connection to the Ray cluster (joined at ``RR_RAY_ADDRESS``, default ``auto``,
unless this process is already in it, as a verl / OpenRLHF worker is)."""

from __future__ import annotations

from collections.abc import Sequence

from rr_client.core import settings
from rr_client.core.errors import ProtocolError, RoutingExpiredError
from rr_client.core.optional import require
from rr_client.core.reference import FramePart, RoutingRef, checksum

__all__ = ["read_parts", "parse_ray_url"]


def parse_ray_url(url: str) -> tuple[str, str]:
    """``ray://<namespace>/<actor>`` -> (namespace, actor name)."""
    rest = url[len("ray://") :] if url.startswith("ray://") else ""
    ns, _, name = rest.partition("/")
    if not ns or not name or "/" in name:
        raise ProtocolError(f"routing ref URL {url!r} is not ray://<namespace>/<actor>")
    return ns, name


def read_parts(url: str, refs: Sequence[RoutingRef]) -> list[FramePart]:
    """The rows of ``refs`` (all held by the store actor at ``url``), each with the checksum of what arrived."""
    ray = require("ray", for_what="resolving ray:// routing refs")
    ns, name = parse_ray_url(url)
    if not ray.is_initialized():
        ray.init(
            address=settings.text("RR_RAY_ADDRESS") or "auto",
            namespace=ns,
            log_to_driver=False,
            ignore_reinit_error=True,
        )
    try:
        actor = ray.get_actor(name, namespace=ns)
    except ValueError:
        raise RoutingExpiredError(
            f"{url}: no such Ray routing store actor (its node or the cluster went away)"
        ) from None
    located = ray.get(actor.locate.remote([(r.store, r.key) for r in refs]))
    gone = [why for obj, why in located if obj is None]
    if gone:
        raise RoutingExpiredError(
            f"{url}: " + "; ".join(gone[:4]) + (f" (+{len(gone) - 4} more)" if len(gone) > 4 else "")
        )
    arrays = ray.get([obj for obj, _ in located])
    return [FramePart(r.key, 0, int(a.shape[0]), a, checksum(a)) for r, a in zip(refs, arrays)]
