"""Which servers a client's credentials may reach: its replicas and the hosts the user allows, nothing a ref names.

Refs travel through controllers, Ray and datasets, and their checksum covers the rows, not the URL: a ref naming
another host must not make the client send its key there. :class:`HostPolicy` decides, per URL a ref names,
whether it is read with the client's key and headers (``"key"``), without them (``"keyless"``), or refused
(:class:`UntrustedHostError`). Core: no httpx.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from rr_client.core import settings
from rr_client.core.errors import ConfigurationError, UntrustedHostError

__all__ = ["HostPolicy", "host_list", "TRUSTED_HOSTS_ENV", "KEYLESS_HOSTS_ENV"]

TRUSTED_HOSTS_ENV = "RR_TRUSTED_HOSTS"
KEYLESS_HOSTS_ENV = "RR_KEYLESS_HOSTS"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str, what: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an ``http(s)://`` URL, lower-cased, the scheme's port when none is given."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise UntrustedHostError(f"{what} {url!r} is not a URL: {e}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in _DEFAULT_PORTS or not host:
        raise UntrustedHostError(f"{what} {url!r} is not an http:// or https:// URL with a host")
    return scheme, host, port if port is not None else _DEFAULT_PORTS[scheme]


def _entry(text: str) -> tuple[str, int | None]:
    """A host-list entry: ``host``, ``host:port`` or a URL (its host and port); ``[::1]:8000`` for IPv6."""
    raw = text.strip()
    if not raw:
        raise ConfigurationError("empty entry in a host list")
    if "://" in raw:
        _, host, port = _origin(raw, "host-list entry")
        return host, port
    try:
        parts = urlsplit("//" + raw)
        port = parts.port
    except ValueError as e:
        raise ConfigurationError(f"host-list entry {raw!r}: {e}") from None
    if not parts.hostname or parts.path or parts.query:
        raise ConfigurationError(f"host-list entry {raw!r} is not host or host:port")
    return parts.hostname.lower(), port


def host_list(given: Iterable[str] | str | None, env: str) -> frozenset[tuple[str, int | None]]:
    """Entries given to the client (a list, or one comma-separated string), else the comma-separated ``env``."""
    if given is None:
        given = settings.text(env) or ""
    items = given.split(",") if isinstance(given, str) else list(given)
    return frozenset(_entry(i) for i in items if isinstance(i, str) and i.strip())


@dataclass(frozen=True)
class HostPolicy:
    """Who gets the client's credentials: the replicas (same scheme, host and port) and ``trusted`` hosts; the
    ``keyless`` hosts are read without them; a client holding no credentials reads any host (nothing to leak).
    An ``http://`` ref to another server is refused when any of the client's own servers is ``https://``."""

    replicas: tuple[tuple[str, str, int], ...]
    trusted: frozenset[tuple[str, int | None]]
    keyless: frozenset[tuple[str, int | None]]
    credentials: bool

    @classmethod
    def of(
        cls,
        replica_urls: Sequence[str],
        *,
        trusted: Iterable[str] | str | None,
        keyless: Iterable[str] | str | None,
        credentials: bool,
    ) -> HostPolicy:
        """From the client's replica URLs and arguments (``None``: ``RR_TRUSTED_HOSTS`` / ``RR_KEYLESS_HOSTS``)."""
        origins = []
        for u in replica_urls:
            try:
                origins.append(_origin(u, "replica URL"))
            except UntrustedHostError:  # not an http(s) URL: no ref can name it
                continue
        return cls(
            tuple(origins), host_list(trusted, TRUSTED_HOSTS_ENV), host_list(keyless, KEYLESS_HOSTS_ENV), credentials
        )

    def decide(self, url: str) -> Literal["key", "keyless"]:
        """How a ref naming ``url`` is read; :class:`UntrustedHostError` naming the host and the settings."""
        scheme, host, port = _origin(url, "routing ref URL")
        if (scheme, host, port) in self.replicas:
            return "key"
        if scheme == "http" and any(r[0] == "https" for r in self.replicas):
            raise UntrustedHostError(
                f"routing ref URL {url!r} is http:// while this client's servers are https://: "
                "refused (its key and the rows would travel in clear)"
            )
        if _listed(self.trusted, host, port):
            return "key"
        if _listed(self.keyless, host, port) or not self.credentials:
            return "keyless"
        raise UntrustedHostError(
            f"routing ref URL {url!r} names {host}:{port}, which is none of this client's replicas "
            f"({', '.join(f'{s}://{h}:{p}' for s, h, p in self.replicas)}): its key is not sent there. Allow the host "
            f"with trusted_hosts= or {TRUSTED_HOSTS_ENV} (sent the key), or keyless_hosts= or {KEYLESS_HOSTS_ENV} "
            "(read without it)"
        )


def _listed(entries: frozenset[tuple[str, int | None]], host: str, port: int) -> bool:
    return (host, port) in entries or (host, None) in entries
