"""DiskWeightSync against a recording fake engine over loopback HTTP (no real engine): engine kinds, the API key
(argument over ``RR_API_KEY``, sent on every call, never echoed), and the typed errors saying what to do."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rr_client.core.errors import ConfigurationError, WeightSyncError
from rr_client.integrations.weight_sync import DiskWeightSync, WeightEngine
from tests.support.threaded_server import ThreadedServer

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: a call there would fail


@dataclasses.dataclass
class FakeEngine:
    """What the fake answers; every request lands in ``calls`` as (method, path, authorization, JSON body)."""

    url: str = ""
    info: dict[str, Any] | None = dataclasses.field(default_factory=lambda: {"engine": "vllm"})  # None: 404
    key: str | None = None  # when set, every route answers 401 unless this bearer key is sent
    status: dict[str, int] = dataclasses.field(default_factory=dict)  # path -> forced status
    replies: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> JSON body (a list: one per call)
    calls: list[tuple[str, str, str | None, Any]] = dataclasses.field(default_factory=list)

    async def answer(self, request: Request) -> Response:
        raw = await request.body()
        auth = request.headers.get("authorization")
        path = request.url.path
        self.calls.append((request.method, path, auth, await request.json() if raw else None))
        if self.key is not None and auth != f"Bearer {self.key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if path in self.status:
            return JSONResponse({"detail": "forced"}, status_code=self.status[path])
        if path == "/rr/info":
            return JSONResponse(self.info) if self.info is not None else JSONResponse({}, status_code=404)
        reply = self.replies.get(path, {})
        if isinstance(reply, list):  # answers in turn, the last one from then on
            reply = reply.pop(0) if len(reply) > 1 else reply[0]
        return JSONResponse(reply)

    def paths(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p, _, _ in self.calls]


class FakeModel:
    """Stands in for a PreTrainedModel: ``save_pretrained`` writes one file."""

    def save_pretrained(self, path: Path, *, state_dict: Any = None, safe_serialization: bool = True) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"weights")


class _Current:
    """The FakeEngine of the running test (the loopback server is shared by the module)."""

    engine = FakeEngine()


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def route(request: Request) -> Response:
        return await _Current.engine.answer(request)

    with ThreadedServer(app, name="fake engine") as s:
        yield s


@pytest.fixture
def fake(server: ThreadedServer, monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    monkeypatch.delenv("RR_API_KEY", raising=False)
    _Current.engine = FakeEngine(url=server.url)
    return _Current.engine


def test_weight_engine_validates_its_kind_and_url() -> None:
    e = WeightEngine("http://h:1", "sglang")
    assert (e.url, e.kind) == ("http://h:1", "sglang")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.kind = "vllm"  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match="kind must be one of 'vllm', 'sglang'"):
        WeightEngine("http://h:1", "trtllm")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not an http"):
        WeightEngine("h:1", "vllm")


def test_engine_argument_shapes(tmp_path: Path) -> None:
    """A URL, a WeightEngine, a sequence of either, the older {url: kind}; named kinds need no network."""
    assert DiskWeightSync(UNREACHABLE + "/", tmp_path).urls == [UNREACHABLE]
    one = DiskWeightSync(WeightEngine(UNREACHABLE, "sglang"), tmp_path)
    assert one.engine(UNREACHABLE) == "sglang" and one.engines == [WeightEngine(UNREACHABLE, "sglang")]
    mixed = DiskWeightSync(["http://a:1", WeightEngine(UNREACHABLE, "vllm"), "http://a:1"], tmp_path)
    assert mixed.urls == ["http://a:1", UNREACHABLE] and mixed.engine(UNREACHABLE) == "vllm"
    assert DiskWeightSync({UNREACHABLE: "vllm"}, tmp_path).engine(UNREACHABLE) == "vllm"
    with pytest.raises(ConfigurationError, match="at least one engine"):
        DiskWeightSync([], tmp_path)
    with pytest.raises(ValueError):  # ConfigurationError is a ValueError, as the old check raised
        DiskWeightSync((), tmp_path)
    with pytest.raises(ConfigurationError, match="named both"):
        DiskWeightSync([WeightEngine(UNREACHABLE, "vllm"), WeightEngine(UNREACHABLE, "sglang")], tmp_path)
    with pytest.raises(ConfigurationError, match="kind must be"):
        DiskWeightSync({UNREACHABLE: "tgi"}, tmp_path)
    with pytest.raises(ConfigurationError, match="not an http"):
        DiskWeightSync(["localhost:8000"], tmp_path)


def test_vllm_push_asks_info_once_and_sends_reload_then_reset(fake: FakeEngine, tmp_path: Path) -> None:
    with DiskWeightSync(fake.url, tmp_path) as sync:
        sync.push(FakeModel(), 1)
        sync.push(FakeModel(), 2)
    step = str((tmp_path / "step-2").resolve())
    assert fake.paths() == [("GET", "/rr/info")] + [("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")] * 2
    assert fake.calls[-2][3] == {"method": "reload_weights", "kwargs": {"weights_path": step}}
    assert not (tmp_path / "step-1").exists() and (tmp_path / "step-2" / "model.safetensors").exists()
    assert all(auth is None for _, _, auth, _ in fake.calls)  # no key anywhere: no header


def test_sglang_body_shape_and_refusal(fake: FakeEngine, tmp_path: Path) -> None:
    with DiskWeightSync(WeightEngine(fake.url, "sglang"), tmp_path) as sync:
        sync.push(FakeModel(), 3)
        assert fake.paths() == [("POST", "/update_weights_from_disk"), ("POST", "/flush_cache")]  # no /rr/info
        assert fake.calls[0][3] == {"model_path": str((tmp_path / "step-3").resolve())}
        fake.replies["/update_weights_from_disk"] = {"success": False, "message": "shape mismatch in layer 3"}
        with pytest.raises(WeightSyncError, match="refused the weights .*shape mismatch in layer 3"):
            sync.push(FakeModel(), 4)


def test_a_refused_cache_reset_is_retried_then_fails_the_push(fake: FakeEngine, tmp_path: Path) -> None:
    """vLLM 0.30+ answers ``/reset_prefix_cache`` 200 ``{"success": false}`` while requests hold blocks: retried
    until it works; still refused after ``cache_reset_s``, the push fails (rollouts would hit old-weight KV)."""
    fake.replies["/reset_prefix_cache"] = [{"success": False}, {"success": False}, {"success": True}]
    with DiskWeightSync(fake.url, tmp_path, cache_reset_s=30.0) as sync:
        sync.push(FakeModel(), 1)
        assert fake.paths().count(("POST", "/reset_prefix_cache")) == 3
        fake.replies["/reset_prefix_cache"] = [{"success": False}]
        sync.cache_reset_s = 0.3
        with pytest.raises(WeightSyncError, match=r"reset_prefix_cache .*refused for 0 s .*'success': False.*pause"):
            sync.push(FakeModel(), 2)
    assert fake.paths().count(("POST", "/reset_prefix_cache")) > 4


def test_sglang_flush_refused_while_requests_run_fails_the_push(fake: FakeEngine, tmp_path: Path) -> None:
    fake.status["/flush_cache"] = 400  # SGLang: "the operation will not be performed" while requests run
    with DiskWeightSync(WeightEngine(fake.url, "sglang"), tmp_path, cache_reset_s=0.2) as sync:
        with pytest.raises(WeightSyncError, match="/flush_cache answered 400"):
            sync.push(FakeModel(), 1)
    assert fake.paths().count(("POST", "/flush_cache")) > 1  # retried before giving up


@pytest.mark.parametrize("source", ["argument", "env"])
def test_api_key_sent_on_every_call_argument_first(
    fake: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    monkeypatch.setenv("RR_API_KEY", "env-key")
    fake.key = "arg-key" if source == "argument" else "env-key"
    sync = DiskWeightSync(fake.url, tmp_path, api_key="arg-key" if source == "argument" else None)
    with sync:
        sync.push(FakeModel(), 1)
    assert fake.paths() == [("GET", "/rr/info"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")]
    assert {auth for _, _, auth, _ in fake.calls} == {f"Bearer {fake.key}"}


@pytest.mark.parametrize(
    ("api_key", "env", "says"),
    [
        (None, None, "no API key was sent"),
        ("wrong-arg-key", "right-key", "the API key from the api_key argument was refused"),
        (None, "wrong-env-key", "the API key from RR_API_KEY was refused"),
    ],
)
def test_401_is_a_weight_sync_error_naming_the_source_never_the_key(
    fake: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api_key: str | None, env: str | None, says: str
) -> None:
    if env is not None:
        monkeypatch.setenv("RR_API_KEY", env)
    fake.key = "right-key"
    with DiskWeightSync(fake.url, tmp_path, api_key=api_key) as sync, pytest.raises(WeightSyncError) as err:
        sync.push(FakeModel(), 1)
    msg = str(err.value)
    assert f"{fake.url}/rr/info answered 401" in msg and says in msg
    assert "wrong-" not in msg and "right-key" not in msg
    assert not (tmp_path / "step-1").exists()  # refused before anything was saved


def test_403_on_reload_of_a_named_engine(fake: FakeEngine, tmp_path: Path) -> None:
    fake.status["/collective_rpc"] = 403
    with (
        DiskWeightSync(WeightEngine(fake.url, "vllm"), tmp_path, api_key="k-secret") as sync,
        pytest.raises(WeightSyncError, match=r"/collective_rpc answered 403 .*api_key argument was refused") as err,
    ):
        sync.push(FakeModel(), 1)
    assert fake.calls[0][2] == "Bearer k-secret" and "k-secret" not in str(err.value)


def test_info_404_says_to_pass_weight_engine(fake: FakeEngine, tmp_path: Path) -> None:
    """An engine without rr's plugin (e.g. behind the sidecar): the plain URL fails, a WeightEngine works."""
    fake.info = None
    with DiskWeightSync(fake.url, tmp_path) as sync, pytest.raises(WeightSyncError) as err:
        sync.push(FakeModel(), 1)
    msg = str(err.value)
    assert "is not an rr server" in msg and f"WeightEngine('{fake.url}', 'vllm')" in msg
    assert not (tmp_path / "step-1").exists()
    fake.calls.clear()
    with DiskWeightSync(WeightEngine(fake.url, "vllm"), tmp_path) as sync:
        sync.push(FakeModel(), 1)
    assert fake.paths() == [("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")]


def test_sidecar_url_names_the_engine_behind_it(fake: FakeEngine, tmp_path: Path) -> None:
    fake.info = {"engine": "vllm", "sidecar": True, "upstream": "http://10.0.0.5:8000"}
    with (
        DiskWeightSync(fake.url, tmp_path) as sync,
        pytest.raises(WeightSyncError, match=r"rr's sidecar .*WeightEngine\('http://10.0.0.5:8000', 'vllm'\)"),
    ):
        sync.push(FakeModel(), 1)


def test_vllm_without_dev_mode(fake: FakeEngine, tmp_path: Path) -> None:
    fake.status["/collective_rpc"] = 404
    with DiskWeightSync(fake.url, tmp_path) as sync, pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
        sync.push(FakeModel(), 1)
    assert (tmp_path / "step-1" / "model.safetensors").exists()  # saved completely before the engine was asked


def test_unknown_engine_and_unreachable(fake: FakeEngine, tmp_path: Path) -> None:
    fake.info = {"engine": "trtllm"}
    with DiskWeightSync(fake.url, tmp_path) as sync, pytest.raises(WeightSyncError, match="names engine 'trtllm'"):
        sync.push(FakeModel(), 1)
    with (
        DiskWeightSync(WeightEngine(UNREACHABLE, "vllm"), tmp_path, timeout=5) as sync,
        pytest.raises(WeightSyncError, match="ConnectError"),
    ):
        sync.push(FakeModel(), 1)
