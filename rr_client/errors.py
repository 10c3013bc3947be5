"""Typed errors: every way routing data can be wrong has its own class, so callers can catch precisely."""

from __future__ import annotations

__all__ = [
    "RRError",
    "RoutedExpertsError",
    "MalformedPayloadError",
    "ShapeMismatchError",
    "ExpertIdOutOfRangeError",
    "UnrecordedRoutingError",
    "MissingRoutingError",
    "TransportError",
    "ServerError",
    "RequestRejectedError",
    "ProtocolError",
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


class TransportError(RRError):
    """The server could not be reached or the connection broke (after retries)."""


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


class ProtocolError(RRError):
    """The server answered 2xx with a body that does not follow the /generate protocol."""
