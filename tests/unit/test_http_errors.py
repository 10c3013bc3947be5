"""httpx failures and HTTP error answers -> rr's typed errors: the one table the client and the sidecar share."""

from __future__ import annotations

import httpx
import pytest

from rr_client.client.http_errors import error_for_status, map_httpx_error, response_message
from rr_client.core import errors
from rr_server.proxy.errors import upstream_transport_error

REQ = httpx.Request("POST", "http://127.0.0.1:1/generate")


def _resp(status: int, body: object = None, text: str | None = None) -> httpx.Response:
    if text is not None:
        return httpx.Response(status, text=text, request=REQ)
    return httpx.Response(status, json=body if body is not None else {"message": f"status {status}"}, request=REQ)


@pytest.mark.parametrize(
    "status,err",
    [
        (401, errors.AuthenticationError),
        (403, errors.AuthenticationError),
        (404, errors.RequestRejectedError),
        (400, errors.RequestRejectedError),
        (422, errors.RequestRejectedError),
        (500, errors.ServerError),
        (503, errors.ServerError),
    ],
)
def test_error_for_status(status: int, err: type[errors.RRError]) -> None:
    e = error_for_status(_resp(status, {"error": {"message": "engine says no"}}), "POST /generate")
    assert type(e) is err
    assert e.status_code == status  # type: ignore[union-attr]
    assert str(e).startswith(f"POST /generate: HTTP {status}: engine says no")
    if err is errors.AuthenticationError:
        assert isinstance(e, errors.RequestRejectedError)  # never retried, like every 4xx
        assert "API key" in str(e)


@pytest.mark.parametrize("status", [200, 201, 204, 301])
def test_error_for_status_none_below_400(status: int) -> None:
    assert error_for_status(httpx.Response(status, request=REQ), "GET /x") is None


@pytest.mark.parametrize(
    "exc,err,words",
    [
        (httpx.ConnectError("refused"), errors.ConnectError, "unreachable"),
        (httpx.ConnectTimeout("slow connect"), errors.ConnectError, "unreachable"),  # a connect timeout is unreachable
        (httpx.ReadTimeout("slow answer"), errors.RequestTimeoutError, "timed out"),
        (httpx.WriteTimeout("slow send"), errors.RequestTimeoutError, "timed out"),
        (httpx.PoolTimeout("pool"), errors.RequestTimeoutError, "timed out"),
        (httpx.RemoteProtocolError("peer closed connection"), errors.ConnectionLostError, "connection lost"),
        (httpx.ReadError("reset by peer"), errors.ConnectionLostError, "connection lost"),
    ],
)
def test_map_httpx_error(exc: httpx.HTTPError, err: type[errors.TransportError], words: str) -> None:
    e = map_httpx_error(exc, "POST /generate")
    assert type(e) is err and isinstance(e, errors.TransportError)
    assert str(e).startswith(f"POST /generate: {words} ({type(exc).__name__}: ")


def test_sidecar_maps_transport_errors_to_statuses() -> None:
    """The sidecar turns the same typed errors into 503 / 504 / 502 with a metrics kind."""
    for exc, status, kind in (
        (httpx.ConnectError("x"), 503, "upstream_unavailable"),
        (httpx.ReadTimeout("x"), 504, "upstream_timeout"),
        (httpx.RemoteProtocolError("x"), 502, "upstream_disconnected"),
    ):
        pe = upstream_transport_error("http://up", map_httpx_error(exc, "/generate"))
        assert (pe.status, pe.kind) == (status, kind) and pe.message.startswith("upstream http://up: ")


@pytest.mark.parametrize(
    "resp,msg",
    [
        (_resp(400, {"error": {"message": "vllm style", "code": 400}}), "vllm style"),
        (_resp(400, {"message": "sglang style"}), "sglang style"),
        (_resp(422, {"detail": [{"loc": ["body"], "msg": "bad"}]}), '[{"loc":["body"],"msg":"bad"}]'),
        (_resp(401, {"error": "Unauthorized"}), "Unauthorized"),
        (_resp(502, text="<html>bad gateway</html>"), "<html>bad gateway</html>"),
        (_resp(500, text=""), "HTTP 500"),
    ],
)
def test_response_message(resp: httpx.Response, msg: str) -> None:
    assert response_message(resp) == msg
