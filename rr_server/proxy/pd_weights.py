"""The P/D sidecar's count of the weight updates each of its two servers took, so halves from servers at different
weights are never joined.

SGLang's own ``weight_version`` label stays ``"default"`` under rr's ``DiskWeightSync`` (its reload body names no
version), so two servers' labels agree whatever weights they hold. The sidecar forwards each weight route to the
prefill server, then the decode server (:func:`forward_weights`), and numbers every update it forwards
(:func:`rr_server.serving.weight_epoch.update_kind`): each server's count is the number of the last update it took
(answered 2xx). An answer that is not 2xx, or no answer, leaves that server's weights unknown (SGLang answers 400
both for a load it rolled back and for weights loaded whose cache flush failed); a server never asked (the prefill
server failed first) keeps its count. The next update both servers take brings the counts together again.
:meth:`UpdateLedger.refusal` says why a sample's halves cannot be joined while the counts differ. Updates pushed
straight to the engines are not seen here (push through the sidecar, or see docs/scale-out.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from rr_server.proxy.errors import ProxyError
from rr_server.proxy.upstream import Upstream
from rr_server.serving.weight_epoch import update_kind

__all__ = ["UpdateLedger", "forward_weights"]

Counts = tuple[int | None, ...]


class UpdateLedger:
    """Per server (by URL, in the sidecar's order: prefill, decode) the number of the last weight update it took
    through this sidecar; None: unknown (it answered an update with an error, or not at all)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = tuple(urls)
        self._last: dict[str, int | None] = dict.fromkeys(self._urls, 0)
        self._n = 0

    def begin(self, route: str, body: bytes) -> int | None:
        """The number of the update a weight route's call makes, or None when it changes no weights."""
        if update_kind(route, body) not in ("update", "finish"):
            return None
        self._n += 1
        return self._n

    def took(self, url: str, update: int | None, answered_ok: bool) -> None:
        """Record ``url``'s answer to update number ``update`` (None: not an update, nothing changes)."""
        if update is not None:
            self._last[url] = update if answered_ok else None

    def counts(self) -> Counts:
        """Each server's count, in the sidecar's order."""
        return tuple(self._last[u] for u in self._urls)

    def info(self) -> dict[str, int | None]:
        """``/rr/info``'s ``pd_weight_updates``: each server's URL and its count."""
        return dict(self._last)

    def refusal(self, *snapshots: Counts) -> str | None:
        """Why halves cannot be joined: in one of ``snapshots`` (the counts at a sample's admission, now) the
        servers' counts differ or one is unknown; None when they took the same updates."""
        for counts in snapshots:
            if None in counts or len(set(counts)) > 1:
                said = ", ".join(
                    f"the {role} server ({u}) {'unknown' if c is None else c}"
                    for role, u, c in zip(("prefill", "decode"), self._urls, counts)
                )
                return (
                    f"the servers took different weight updates through this sidecar (the last update each took: "
                    f"{said}): an update reached one server only or failed on one, so the decode tokens may have "
                    "attended to KV computed under other weights; send the update again through the sidecar (it "
                    "goes to both servers)"
                )
        return None


async def forward_weights(
    upstreams: Sequence[Upstream], route: str, content: bytes, ledger: UpdateLedger | None
) -> httpx.Response:
    """Forward a weight route to each upstream in order (the first failure is the answer: later ones are not
    asked), recording in ``ledger`` (P/D) which server took the update."""
    update = ledger.begin(route, content) if ledger is not None else None
    resp: httpx.Response | None = None
    for up in upstreams:
        try:
            resp = await up.forward(route, content)
        except ProxyError:
            if ledger is not None:
                ledger.took(up.url, update, False)
            raise
        if ledger is not None:
            ledger.took(up.url, update, resp.status_code < 300)
        if resp.status_code >= 400:
            break
    assert resp is not None  # at least one upstream
    return resp
