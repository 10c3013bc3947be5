"""Typed errors: every way routing or a call can go wrong has its own class, so callers catch precisely.

Imports nothing heavy. The hierarchy::

    RRError
    ├── RoutedExpertsError (ValueError)   routing that cannot be trusted
    │   ├── MalformedPayloadError         bad base64 / .npy header / dtype / truncated
    │   ├── ShapeMismatchError            rows, layers, top-k, stated shape, dense-layer mismatch
    │   ├── ExpertIdOutOfRangeError       id >= num_experts (or negative)
    │   ├── UnrecordedRoutingError        all-zero or repeated ids in an MoE row
    │   ├── MissingRoutingError           asked for routing, got none (incl. SGLang's ``{}``)
    │   ├── TokenMismatchError            a turn's prompt does not begin with the trajectory's tokens
    │   ├── RoutingExpiredError           a routing ref's rows are gone (evicted, retired, server restarted)
    │   ├── RoutingChecksumError          rows read by reference differ from what their ref promised
    │   ├── RoutingStoreWriteError        a ref's rows could not be written to its object store (that sample only)
    │   ├── ProvenanceSpanError           a datum's provenance spans do not tile it or point outside a sequence
    │   ├── StaleRoutingError             rows may come from other weights / tokens than the sample's (provenance)
    │   ├── SeamMismatchError             a prefill/decode sample's halves cannot be joined (model, shape, KV claim)
    │   └── IndexerPositionError          an indexer row picks a future or negative position, or one twice
    ├── TransportError                    no usable answer from the server (after retries)
    │   ├── ConnectError                  refused / unreachable
    │   ├── RequestTimeoutError           connect, read or write timed out
    │   ├── ConnectionLostError           the connection broke mid-request
    │   └── ServerStartError (RuntimeError)  a server rr started never became healthy (with its log's tail)
    ├── ServerError                       5xx (after retries)
    ├── RequestRejectedError              4xx with the server's message (never retried)
    │   └── AuthenticationError           401 / 403: missing or wrong API key
    ├── ProtocolError                     2xx but not the protocol
    │   └── ReplicaMismatchError          replicas of one client serve different models / routing dims
    ├── ReplayError                       replay/recording in the trainer did not (provably) take effect
    │   └── UnsupportedModelError (TypeError)  a model family or router rr cannot replay exactly, with the reason
    ├── WeightSyncError                   the trained weights did not reach the engine (training must stop)
    ├── UnsupportedVersionError (RuntimeError)  an engine / trainer release rr was not tested on, or code that
    │                                     no longer has the shape rr wraps (one override: RR_ALLOW_UNSUPPORTED_VERSION)
    ├── MissingDependencyError (ImportError)  an optional dependency of the part you use is not installed
    ├── ConfigurationError (ValueError)   a setting or argument rr refuses (named, with what to do instead)
    │   ├── ArgumentTypeError (TypeError) an argument of a type rr does not take
    │   ├── LogprobsModeError             engine and trainer log-probs mean different things (names the flag)
    │   └── UntrustedHostError            a ref names a host the client does not send its key to
    └── SettingError (ValueError)         an ``RR_*`` environment variable holds a value it cannot parse
"""

from __future__ import annotations

__all__ = [
    "RRError",
    "RoutedExpertsError",
    "MalformedPayloadError",
    "ShapeMismatchError",
    "ExpertIdOutOfRangeError",
    "UnrecordedRoutingError",
    "MissingRoutingError",
    "TokenMismatchError",
    "RoutingExpiredError",
    "RoutingStoreWriteError",
    "ProvenanceSpanError",
    "RoutingChecksumError",
    "StaleRoutingError",
    "SeamMismatchError",
    "IndexerPositionError",
    "TransportError",
    "ConnectError",
    "RequestTimeoutError",
    "ConnectionLostError",
    "ServerStartError",
    "ServerError",
    "RequestRejectedError",
    "AuthenticationError",
    "NotAnRRServerError",
    "ProtocolError",
    "ReplicaMismatchError",
    "ReplayError",
    "UnsupportedModelError",
    "WeightSyncError",
    "UnsupportedVersionError",
    "MissingDependencyError",
    "ConfigurationError",
    "ArgumentTypeError",
    "LogprobsModeError",
    "UntrustedHostError",
    "SettingError",
]


class RRError(Exception):
    """Base of every error rr raises."""


class RoutedExpertsError(RRError, ValueError):
    """Routing data that cannot be trusted; base of the payload/validation errors."""


class MalformedPayloadError(RoutedExpertsError):
    """The payload cannot be parsed: bad base64, bad .npy header, wrong type or dtype, truncated data."""


class ShapeMismatchError(RoutedExpertsError):
    """The payload parsed but its shape disagrees with what the request/model implies (rows, layers, top-k)."""


class ExpertIdOutOfRangeError(RoutedExpertsError):
    """An expert id lies outside ``[0, num_experts)``."""


class UnrecordedRoutingError(RoutedExpertsError):
    """A row that cannot be real routing: all-zero or repeated ids in an MoE layer (the engine did not capture it)."""


class MissingRoutingError(RoutedExpertsError):
    """Routing was requested but the answer carries none (absent, null, or the SGLang ``{}`` loss)."""


class TokenMismatchError(RoutedExpertsError):
    """A turn's prompt, as the engine tokenized it, does not begin with the tokens the trajectory holds.

    Typically a chat template that re-tokenized an earlier turn differently: every later routing row would
    sit on the wrong token. ``position`` is the first differing index; ``expected``/``got`` the ids there
    (``got`` is None when the engine's prompt is shorter than the trajectory).
    """

    def __init__(self, message: str, *, position: int, expected: int, got: int | None) -> None:
        super().__init__(message)
        self.position, self.expected, self.got = position, expected, got


class RoutingExpiredError(RoutedExpertsError):
    """A :class:`rr_client.RoutingRef`'s rows are no longer held (evicted by the store's byte cap, retired with
    their weight version, or the server restarted): never answered with zeros or another request's rows."""


class RoutingChecksumError(RoutedExpertsError):
    """Rows read by reference do not match the checksum their ref or frame promised."""


class RoutingStoreWriteError(RoutedExpertsError):
    """A sample's rows could not be written to the object store its ref would name (the write failed, timed out, or
    the store's write backlog stayed full): that sample's answer carries this refusal instead of a ref; the rest of
    the batch goes on."""


class ProvenanceSpanError(RoutedExpertsError):
    """A training datum's provenance spans cannot be resolved to rows: they do not tile the datum (a gap, an overlap,
    lengths that do not add up), a span points past its sequence's tokens or rows, names a sequence the book does
    not hold, or the datum's tokens there are not the sequence's (:mod:`rr_client.core.spans`)."""


class StaleRoutingError(RoutedExpertsError):
    """Rows that pass every check but may come from another forward than the sample's tokens: the request was
    preempted / retracted across a weight update (re-prefilled under the new weights while its tokens and log-probs
    keep the old), or a ref is bound to other tokens than the sample it was paired with. Names the sample and its
    :class:`rr_client.core.provenance.Provenance`; ``stale_rows="mask"`` keeps such samples with replay masked off."""


class SeamMismatchError(RoutedExpertsError):
    """A prefill/decode sample's two halves cannot be joined: they differ in model or shape, or the decode server's rows
    contradict the KV it says it received (:mod:`rr_client.core.seam`)."""


class IndexerPositionError(RoutedExpertsError):
    """A sparse-attention indexer row (:mod:`rr_client.core.indexer`) picks a position its token cannot read (a future
    token, a negative one) or one position twice: the engine did not record this row."""


class TransportError(RRError):
    """The server could not be reached or the connection broke (after retries)."""


class ConnectError(TransportError):
    """The server refused the connection or could not be reached."""


class RequestTimeoutError(TransportError):
    """Connecting, sending or waiting for the answer took longer than the timeout."""


class ConnectionLostError(TransportError):
    """The connection broke after the request was sent (server died, reset, protocol error)."""


class ServerStartError(TransportError, RuntimeError):
    """A server rr started (demo, examples, test servers) never answered ``/health``: its process exited, or the
    wait timed out. The message names the URL, the exit code or the time waited, and ends with the log's tail."""


class ServerError(RRError):
    """The server answered 5xx (after retries)."""

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class RequestRejectedError(RRError):
    """The server answered 4xx: the request itself is wrong; never retried."""

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class AuthenticationError(RequestRejectedError):
    """The server answered 401 or 403: the API key is missing or wrong; never retried."""


class NotAnRRServerError(RequestRejectedError):
    """The URL answered 404 on ``/rr/info``: no rr routes there (an engine without rr's plugin, or a router that does
    not forward them). The message says the ways out: ``rr-server launch``, ``rr-server proxy``, ``info=``."""


class ProtocolError(RRError):
    """The server answered 2xx with a body that does not follow the /generate protocol."""


class ReplicaMismatchError(ProtocolError):
    """The replicas given to one client do not serve the same model (their ``/rr/info`` disagree)."""


class ReplayError(RRError):
    """Routing cannot be replayed or recorded correctly on this model, or the replay audit found that it was not.

    Raised by :mod:`rr_client.trainer.replay`: an orphan router (in the model, never ran), replayed rows no router
    consumed, replayed ids that did not reach the experts, a checkpointed forward left without its backward.
    ``report`` holds the audit's numbers when the audit raised it (else None).
    """

    def __init__(self, message: str, *, report: dict | None = None) -> None:
        super().__init__(message)
        self.report = report


class UnsupportedModelError(ReplayError, TypeError):
    """A model family or router rr cannot replay exactly (named, with the reason), or a kernel that replaces
    the whole MoE block so its router never runs."""


class WeightSyncError(RRError):
    """Pushing the trainer's weights to the engine failed (save, reload route missing or refused, engine error), or
    the engine's own weight checksums show it does not hold what was pushed: the next rollout would come from stale
    or other weights, so the trainer stops instead of training on them.

    Where the engine's checksums found it: ``engine`` names the engine(s) (URLs), ``tensors`` the tensors and
    ``ranks`` their ranks (``dp0:pp0:pcp0:tp0``); empty otherwise.
    """

    def __init__(
        self, message: str, *, engine: str = "", tensors: tuple[str, ...] = (), ranks: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.engine, self.tensors, self.ranks = engine, tensors, ranks


class UnsupportedVersionError(RRError, RuntimeError):
    """An engine or trainer release outside what rr was tested on, or code whose shape rr no longer recognises.

    ``package`` and ``version`` name what was found; ``tested`` says what rr was tested on. The one override is
    ``RR_ALLOW_UNSUPPORTED_VERSION=1`` (and the launchers' ``--rr-allow-unsupported-version``).
    """

    def __init__(self, message: str, *, package: str = "", version: str = "", tested: str = "") -> None:
        super().__init__(message)
        self.package, self.version, self.tested = package, version, tested


class MissingDependencyError(RRError, ImportError):
    """An optional dependency the part of rr you use needs is not installed (names the extra to install)."""


class ConfigurationError(RRError, ValueError):
    """A setting or argument rr refuses (names it, what it holds and what rr accepts or what to do instead)."""


class ArgumentTypeError(ConfigurationError, TypeError):
    """An argument of a type rr does not take (names the argument and the types it takes)."""


class LogprobsModeError(ConfigurationError):
    """The engine's sampled log-probs and the trainer's would not mean the same thing (e.g. vLLM's ``raw_logprobs``
    sampled at temperature != 1, or with top-k / top-p / min-p / a penalty on: not the distribution sampled from):
    gaps and importance ratios would be wrong, so rr refuses and names the sampling flags and the flag that fixes it
    (``--logprobs-mode processed_logprobs``)."""


class UntrustedHostError(ConfigurationError):
    """A routing ref (or another URL from data) names a host the client does not trust with its API key: neither one
    of its replicas nor in ``RR_TRUSTED_HOSTS``; or an ``http://`` ref while the client's own servers are ``https://``."""


class SettingError(RRError, ValueError):
    """An ``RR_*`` variable holds a value its reader cannot parse (names the variable and what it accepts)."""
