"""RoutedExpertsClient over real HTTP on 127.0.0.1 against the ProtocolTestServer (a test-only server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from rr_client import (
    AuthenticationError,
    ConnectError,
    GenerateBatch,
    MissingRoutingError,
    ProtocolError,
    RequestRejectedError,
    RequestTimeoutError,
    RoutedExpertsClient,
    ServerError,
    ShapeMismatchError,
    TransportError,
    UnrecordedRoutingError,
)
from rr_server.launch.process import free_port
from tests.support.deadlines import STARTUP_TIMEOUT_S
from tests.support.protocol_server import ProtocolTestServer, synthetic_routing


@pytest.fixture
def server() -> Iterator[ProtocolTestServer]:
    with ProtocolTestServer(layers=3, topk=2, num_experts=8, moe_layers=[1, 2]) as s:
        yield s


def expected(s: ProtocolTestServer, tokens: list[int]) -> np.ndarray:
    return synthetic_routing(tokens, s.layers, s.topk, s.num_experts, s.moe_layers)


async def test_generate_text_batch_values_and_order(server: ProtocolTestServer) -> None:
    prompts = ["hello", "a", "routing replay"]
    async with RoutedExpertsClient(server.url, batch_size=2) as c:
        batch = await c.generate(prompts, {"max_new_tokens": 3})
    assert [r.prompt_index for r in batch] == [0, 1, 2]
    for r, p in zip(batch, prompts):
        assert r.prompt_ids == list(p.encode())
        assert r.routed_experts is not None and r.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(r.routed_experts, expected(server, r.prompt_ids + r.output_ids)[:-1])
        assert r.finish_reason == "length"
        assert "routed_experts" not in r.meta
    assert server.behaviour.calls == 2  # 3 prompts in batches of 2


def check_alignment(server: ProtocolTestServer, batch: GenerateBatch, pad_side: str) -> None:
    t = batch.to_tensors(pad_side=pad_side)  # type: ignore[arg-type]
    b, width = t.input_ids.shape
    assert t.routed_experts.shape == (b, width, server.layers, server.topk)
    assert t.routed_experts.dtype == torch.uint8
    for i, r in enumerate(batch):
        n = len(r.prompt_ids or []) + len(r.output_ids)
        off = width - n if pad_side == "left" else 0
        assert t.attention_mask[i].sum() == n
        assert t.attention_mask[i, off : off + n].all()
        assert t.response_mask[i].sum() == len(r.output_ids)
        assert t.response_mask[i, off + n - len(r.output_ids) : off + n].all()
        mask = t.routed_experts_mask[i]
        assert mask.sum() == n - 1 - r.routed_experts_start
        assert not mask[off + n - 1]  # last token has no routing
        tokens = t.input_ids[i, mask].tolist()
        # row at position p is the routing of the token at p
        np.testing.assert_array_equal(t.routed_experts[i, mask].numpy(), expected(server, tokens))
        assert not t.routed_experts[i, ~mask].any()  # pad rows are zero


@pytest.mark.parametrize("pad_side", ["left", "right"])
async def test_to_tensors_alignment(server: ProtocolTestServer, pad_side: str) -> None:
    async with RoutedExpertsClient(server.url) as c:
        batch = await c.generate(["hello world", "x", "abc"], {"max_new_tokens": 4})
    check_alignment(server, batch, pad_side)
    t = batch.to_tensors()
    assert t.attention_mask[1, -1] == 1 and t.attention_mask[1, 0] == 0  # left padding: flush right


async def test_layer_major_and_moe_only(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url) as c:
        batch = await c.generate([[5, 6, 7], [9]], {"max_new_tokens": 2})
    tm = batch.to_tensors()
    lm = batch.to_tensors(layout="layer_major")
    assert lm.routed_experts.shape == (3, 2, tm.input_ids.shape[1], 2)
    torch.testing.assert_close(lm.routed_experts, tm.routed_experts.permute(2, 0, 1, 3))
    moe = batch.to_tensors(moe_layers_only=True)
    assert moe.layers == [1, 2]
    torch.testing.assert_close(moe.routed_experts, tm.routed_experts[:, :, 1:])


async def test_token_ids_and_n_samples_prompt_major(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url, batch_size=1) as c:
        batch = await c.generate([[1, 2, 3], [4, 5]], {"max_new_tokens": 2, "n": 3})
    assert len(batch) == 6
    assert [r.prompt_index for r in batch] == [0, 0, 0, 1, 1, 1]
    assert [r.index for r in batch] == list(range(6))
    assert batch[4].prompt_ids == [4, 5]
    assert len({tuple(r.output_ids) for r in batch.results[:3]}) == 3


async def test_single_prompt_forms(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url) as c:
        assert len(await c.generate("one prompt")) == 1
        one = await c.generate([3, 4, 5])
        assert one[0].prompt_ids == [3, 4, 5]


async def test_routed_experts_start(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url) as c:
        batch = await c.generate([[1, 2, 3, 4, 5]], {"max_new_tokens": 3}, routed_experts_start=2)
    r = batch[0]
    assert r.routed_experts is not None and r.routed_experts.shape[0] == 5 + 3 - 1 - 2
    np.testing.assert_array_equal(r.routed_experts, expected(server, (r.prompt_ids or []) + r.output_ids)[2:-1])
    check_alignment(server, batch, "left")


async def test_given_info_for_a_url_without_rr_info(server: ProtocolTestServer) -> None:
    """Behind a router that 404s ``/rr/info`` (sglang-router): without ``info`` the client raises a typed 404;
    with ``info`` it never asks, and checks every payload against the info it was given."""
    from rr_client import NotAnRRServerError, RRInfo

    server.behaviour.info_status = 404
    info = RRInfo.model_validate(server.info())
    async with RoutedExpertsClient(server.url) as c:
        with pytest.raises(NotAnRRServerError, match="404") as no_rr:  # a RequestRejectedError that says what to do
            await c.generate([[1, 2, 3]], {"max_new_tokens": 2})
    assert isinstance(no_rr.value, RequestRejectedError) and no_rr.value.status_code == 404
    for way_out in ("rr-server launch vllm|sglang", f"rr-server proxy --upstream {server.url}", "pass info=", "doctor"):
        assert way_out in str(no_rr.value), way_out
    calls = server.behaviour.info_calls
    async with RoutedExpertsClient(server.url, info=info) as c:
        batch = await c.generate([[1, 2, 3, 4]], {"max_new_tokens": 3})
    assert server.behaviour.info_calls == calls  # never asked
    r = batch[0]
    np.testing.assert_array_equal(r.routed_experts, expected(server, (r.prompt_ids or []) + r.output_ids)[:-1])
    wrong = RRInfo.model_validate({**info.model_dump(), "topk": 3})
    async with RoutedExpertsClient(server.url, info=wrong) as c:
        with pytest.raises(ShapeMismatchError):
            await c.generate([[1, 2, 3, 4]], {"max_new_tokens": 3})
    with pytest.raises(TypeError):
        RoutedExpertsClient(server.url, info={"topk": 2})  # type: ignore[arg-type]


async def test_routing_off_gives_none_and_tensors_refuse(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url) as c:
        batch = await c.generate(["abc"], return_routed_experts=False)
    assert batch[0].routed_experts is None
    assert server.behaviour.bodies[-1]["return_routed_experts"] is False
    with pytest.raises(MissingRoutingError):
        batch.to_tensors()


async def test_bounded_concurrency_and_order(server: ProtocolTestServer) -> None:
    server.behaviour.delay = 0.05
    prompts = [[i + 1, i + 2] for i in range(20)]
    async with RoutedExpertsClient(server.url, batch_size=3, max_concurrency=2) as c:
        batch = await c.generate(prompts, {"max_new_tokens": 1})
    assert server.behaviour.calls == 7
    assert server.behaviour.max_in_flight <= 2
    assert [r.prompt_ids for r in batch] == prompts


async def test_uint16_above_256_experts() -> None:
    with ProtocolTestServer(layers=2, topk=4, num_experts=300) as s:
        async with RoutedExpertsClient(s.url) as c:
            batch = await c.generate([[290, 291, 299, 5]], {"max_new_tokens": 2})
        r = batch[0]
        assert r.routed_experts is not None and r.routed_experts.dtype == np.uint16
        assert r.routed_experts.max() >= 256
        t = batch.to_tensors()
        assert t.routed_experts.dtype == torch.int16
        np.testing.assert_array_equal(t.routed_experts[0, t.routed_experts_mask[0]].numpy(), r.routed_experts)


# ------------------------------------------------------------------ retries and errors


async def test_retries_5xx_then_succeeds(server: ProtocolTestServer) -> None:
    server.behaviour.fail_5xx = 2
    async with RoutedExpertsClient(server.url, retries=3, backoff=0.01) as c:
        batch = await c.generate(["abc"])
    assert len(batch) == 1 and server.behaviour.calls == 3


async def test_persistent_5xx_raises_server_error(server: ProtocolTestServer) -> None:
    server.behaviour.fail_5xx = 100
    async with RoutedExpertsClient(server.url, retries=2, backoff=0.01) as c:
        with pytest.raises(ServerError, match="503.*engine overloaded") as ei:
            await c.generate(["abc"])
    assert ei.value.status_code == 503 and server.behaviour.calls == 3


async def test_4xx_is_never_retried(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url, retries=3, backoff=0.01) as c:
        with pytest.raises(RequestRejectedError, match="400.*max_new_tokens must be >= 0"):
            await c.generate(["abc"], {"max_new_tokens": -1})
    assert server.behaviour.calls == 1


@pytest.mark.parametrize(
    "status,err", [(401, AuthenticationError), (403, AuthenticationError), (404, RequestRejectedError)]
)
async def test_rejections_are_typed_and_never_retried(
    server: ProtocolTestServer, status: int, err: type[Exception]
) -> None:
    server.behaviour.reject_status = status
    async with RoutedExpertsClient(server.url, retries=3, backoff=0.01) as c:
        with pytest.raises(err, match=f"POST /generate: HTTP {status}: Unauthorized") as ei:
            await c.generate(["abc"])
    assert type(ei.value) is err and ei.value.status_code == status  # type: ignore[attr-defined]
    assert server.behaviour.calls == 1


async def test_connection_refused_is_transport_error() -> None:
    port = free_port()  # nothing listens there
    async with RoutedExpertsClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.01) as c:
        with pytest.raises(
            ConnectError, match=f"GET http://127.0.0.1:{port}/rr/info: unreachable .*ConnectError"
        ) as ei:
            await asyncio.wait_for(c.generate(["abc"]), timeout=STARTUP_TIMEOUT_S)  # a hang fails, never a slow box
    assert isinstance(ei.value, TransportError)


async def test_timeout_is_transport_error_not_hang(server: ProtocolTestServer) -> None:
    async with RoutedExpertsClient(server.url, timeout=0.5, retries=0) as c:
        await c.info()
        server.behaviour.delay = 3
        with pytest.raises(RequestTimeoutError, match=f"POST {server.url}/generate: timed out") as ei:
            await asyncio.wait_for(c.generate(["abc"]), timeout=STARTUP_TIMEOUT_S)
    assert isinstance(ei.value, TransportError)


@pytest.mark.parametrize(
    "corrupt,err,msg",
    [
        ("dup", UnrecordedRoutingError, "sample 0: row 1 layer 1 has repeated ids"),
        ("rows", ShapeMismatchError, "rows, expected"),
        ("missing", MissingRoutingError, "no 'routed_experts' field"),
        ("count", ProtocolError, "expected 2 samples"),
        ("bad_info", ProtocolError, "/rr/info is invalid"),
    ],
)
async def test_malformed_server_answers(
    server: ProtocolTestServer, corrupt: str, err: type[Exception], msg: str
) -> None:
    server.behaviour.corrupt = corrupt
    async with RoutedExpertsClient(server.url) as c:
        with pytest.raises(err, match=msg):
            await c.generate(["abcd", "efgh"], {"max_new_tokens": 2})


async def test_unrequested_routing_is_protocol_error(server: ProtocolTestServer) -> None:
    server.behaviour.corrupt = "unasked"
    async with RoutedExpertsClient(server.url) as c:
        with pytest.raises(ProtocolError, match="not requested"):
            await c.generate(["abcd"], return_routed_experts=False)


async def test_extra_row_allowed_only_when_asked(server: ProtocolTestServer) -> None:
    server.behaviour.corrupt = "rows"
    async with RoutedExpertsClient(server.url, allow_extra_rows=1) as c:
        batch = await c.generate(["abcd"], {"max_new_tokens": 2})
    r = batch[0]
    np.testing.assert_array_equal(r.routed_experts, expected(server, (r.prompt_ids or []) + r.output_ids)[:-1])


@pytest.mark.parametrize("prompts,err", [([], ValueError), ([""], ValueError), ([[1, -2]], TypeError), (3, TypeError)])
async def test_bad_prompts_refused_before_sending(
    server: ProtocolTestServer, prompts: object, err: type[Exception]
) -> None:
    async with RoutedExpertsClient(server.url) as c:
        with pytest.raises(err):
            await c.generate(prompts)  # type: ignore[arg-type]
    assert server.behaviour.calls == 0
