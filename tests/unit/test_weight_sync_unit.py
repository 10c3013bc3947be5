"""DiskWeightSync against a recording fake engine over loopback HTTP (no real engine): engine kinds, the API key
(argument over ``RR_API_KEY``, sent on every call, never echoed), the typed errors saying what to do, and the weight
check's paths that need no real engine: an engine without a checker (vLLM 0.30's 404, SGLang 0.5.7 - 0.5.11's
"Unsupported action") said once and skipped, the opt-out, and the comparison rules on checksums as vLLM 0.32+ words
them. The checks against the engines' real checkers: tests/vllm_standin/test_standin_weights.py (vLLM 0.32/0.33),
tests/sglang/test_weights_checker.py (SGLang 0.5.23)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rr_client.core.errors import ConfigurationError, WeightSyncError
from rr_client.integrations.weight_sync import DiskWeightSync, WeightEngine
from tests.support.threaded_server import ThreadedServer

CHECKERS = ("/weight_checker", "/weights_checker")  # vLLM 0.32+'s, SGLang 0.5.12+'s

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: a call there would fail


@dataclasses.dataclass
class FakeEngine:
    """What the fake answers; every request lands in ``calls`` as (method, path, authorization, JSON body)."""

    url: str = ""
    info: dict[str, Any] | None = dataclasses.field(default_factory=lambda: {"engine": "vllm"})  # None: 404
    key: str | None = None  # when set, every route answers 401 unless this bearer key is sent
    # path -> forced status; the weight checkers are absent unless a test gives them replies (vLLM 0.30, old SGLang)
    status: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CHECKERS, 404))
    replies: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> JSON body (a list: one per call)
    calls: list[tuple[str, str, str | None, Any]] = dataclasses.field(default_factory=list)
    queries: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, query string) of every call

    async def answer(self, request: Request) -> Response:
        raw = await request.body()
        auth = request.headers.get("authorization")
        path = request.url.path
        self.calls.append((request.method, path, auth, await request.json() if raw else None))
        self.queries.append((path, request.url.query))
        if self.key is not None and auth != f"Bearer {self.key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if path in self.status and not (path in CHECKERS and path in self.replies):
            return JSONResponse({"detail": "forced"}, status_code=self.status[path])
        if path == "/rr/info":
            return JSONResponse(self.info) if self.info is not None else JSONResponse({}, status_code=404)
        reply = self.replies.get(path, {})
        if isinstance(reply, list):  # answers in turn, the last one from then on
            reply = reply.pop(0) if len(reply) > 1 else reply[0]
        if isinstance(reply, tuple):  # (status, body)
            return JSONResponse(reply[1], status_code=reply[0])
        return JSONResponse(reply)

    def paths(self, checks: bool = False) -> list[tuple[str, str]]:
        """(method, path) of every call, the weight checkers' left out unless ``checks``."""
        return [(m, p) for m, p, _, _ in self.calls if checks or p not in CHECKERS]


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


@pytest.mark.parametrize(
    ("info", "query"),
    [
        ({"engine": "vllm", "kv_connector": ["OffloadingConnector"]}, "reset_external=true"),
        ({"engine": "vllm"}, "reset_external=true"),  # the server does not say: asked (the tier may be there)
        ({"engine": "vllm", "kv_connector": None}, ""),  # the server runs none (vLLM 0.22 refuses it without one)
    ],
)
def test_vllm_reset_asks_for_the_kv_tier_too(fake: FakeEngine, tmp_path: Path, info: Any, query: str) -> None:
    """vLLM resets a KV connector's offload tier only with ``reset_external=true`` (vLLM #27170; issue 55)."""
    fake.info = info
    with DiskWeightSync(fake.url, tmp_path) as sync:
        sync.push(FakeModel(), 1)
    assert [q for p, q in fake.queries if p == "/reset_prefix_cache"] == [query]


def test_sglang_body_shape_and_refusal(fake: FakeEngine, tmp_path: Path) -> None:
    with DiskWeightSync(WeightEngine(fake.url, "sglang"), tmp_path) as sync:
        sync.push(FakeModel(), 3)
        assert fake.paths() == [("POST", "/update_weights_from_disk"), ("POST", "/flush_cache")]  # no /rr/info
        reload = next(c for c in fake.calls if c[1] == "/update_weights_from_disk")
        assert reload[3] == {"model_path": str((tmp_path / "step-3").resolve())}
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
        with pytest.raises(
            WeightSyncError,
            match=r"reset_prefix_cache\?reset_external=true .*refused for 0 s .*'success': False.*pause",
        ):
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


# ---------------------------------------------------------------- the engines' own weight checkers


class SafetensorsModel:
    """Stands in for a PreTrainedModel whose ``save_pretrained`` writes real safetensors (what the check hashes)."""

    def __init__(self, **tensors: Any) -> None:
        self.tensors = tensors

    def save_pretrained(self, path: Path, *, state_dict: Any = None, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file(
            {k.replace("__", "."): v.contiguous() for k, v in self.tensors.items()}, str(Path(path) / "m.safetensors")
        )


def _sums(**digests: str) -> dict[str, Any]:
    """vLLM 0.32+'s ``/weight_checker`` checksum answer: one tensor-parallel rank per key, ``__`` for ``.``."""
    return {"checksums": {f"dp0:pp0:pcp0:tp0:{k.replace('__', '.')}": v for k, v in digests.items()}}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rr.weight_sync" and r.levelno >= logging.WARNING]


def test_vllm_030_has_no_checker_said_once_and_skipped(
    fake: FakeEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.30 serves no ``/weight_checker`` (404): the push works, the engine is asked once, said once."""
    caplog.set_level(logging.INFO, logger="rr.weight_sync")
    with DiskWeightSync(fake.url, tmp_path) as sync:
        sync.push(FakeModel(), 1)
        sync.push(FakeModel(), 2)
    assert fake.paths(checks=True).count(("POST", "/weight_checker")) == 1
    assert fake.calls[fake.paths(checks=True).index(("POST", "/weight_checker"))][3] == {"action": "checksum"}
    said = _warnings(caplog)
    assert len(said) == 1 and fake.url in said[0] and "serves no /weight_checker" in said[0]
    assert "not verified" in said[0]


def test_sglang_without_checksum_action_is_skipped(
    fake: FakeEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang 0.5.7 - 0.5.11 have ``/weights_checker`` but no ``checksum`` action: 400, said once, skipped."""
    caplog.set_level(logging.INFO, logger="rr.weight_sync")
    fake.replies["/weights_checker"] = (400, {"success": False, "message": "Unsupported action='checksum'"})
    with DiskWeightSync(WeightEngine(fake.url, "sglang"), tmp_path) as sync:
        sync.push(FakeModel(), 1)
        sync.push(FakeModel(), 2)
    assert fake.paths(checks=True).count(("POST", "/weights_checker")) == 1
    said = _warnings(caplog)
    assert len(said) == 1 and "no 'checksum' action" in said[0]


def test_opt_out_never_asks_and_a_failing_checker_fails_the_push(fake: FakeEngine, tmp_path: Path) -> None:
    fake.replies["/weight_checker"] = (500, {"detail": "Duplicate weight checksum keys"})
    with DiskWeightSync(fake.url, tmp_path, verify_weights=False) as sync:
        sync.push(FakeModel(), 1)
    assert ("POST", "/weight_checker") not in fake.paths(checks=True)
    with (
        DiskWeightSync(fake.url, tmp_path) as sync,
        pytest.raises(WeightSyncError, match=r"/weight_checker answered 500 .*Duplicate.*verify_weights=False"),
    ):
        sync.push(FakeModel(), 2)
    with pytest.raises(ConfigurationError, match="verify_skip"):
        DiskWeightSync(fake.url, tmp_path, verify_skip="experts")


def test_replicas_that_disagree_are_named_with_tensor_and_ranks(fake: FakeEngine, tmp_path: Path) -> None:
    """Two replicas (two URLs of the one fake) answer different digests for one tensor: both named (no majority)."""
    port = fake.url.rsplit(":", 1)[1]
    a, b = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    fake.replies["/weight_checker"] = [_sums(model__norm__weight="n1", lm_head__weight="h1")] * 2
    with DiskWeightSync([WeightEngine(a, "vllm"), WeightEngine(b, "vllm")], tmp_path) as sync:
        sync.push(FakeModel(), 1)  # they agree
        fake.replies["/weight_checker"] = [
            _sums(model__norm__weight="n1", lm_head__weight="h1"),
            _sums(model__norm__weight="n1", lm_head__weight="OTHER"),
        ]
        with pytest.raises(WeightSyncError) as err:
            sync.push(FakeModel(), 2)
    msg = str(err.value)
    assert "disagree (no majority" in msg and f"{a} differs" in msg and f"{b} differs" in msg
    assert "lm_head.weight (dp0:pp0:pcp0:tp0)" in msg and "model.norm.weight" not in msg
    assert err.value.tensors == ("lm_head.weight",) and err.value.ranks == ("dp0:pp0:pcp0:tp0",)


def test_the_push_must_show_on_the_engines_own_checksums(fake: FakeEngine, tmp_path: Path) -> None:
    """Against what the trainer changed since the last push (its saved tensors hashed here): a changed tensor the
    engine kept, a no-op reload, an identical tensor the engine changed; a quantized module's weight may keep its
    bytes."""
    torch = pytest.importorskip("torch")
    norm, gate = torch.ones(8), torch.zeros(4, 8)
    model = SafetensorsModel(model__norm__weight=norm, mlp__gate__weight=gate, o_proj__weight=torch.ones(8, 8))
    fake.replies["/weight_checker"] = [  # the baseline before the first reload, then what the first push loaded
        _sums(model__norm__weight="n0", mlp__gate__weight="g0", w13="e0"),
        _sums(model__norm__weight="n1", mlp__gate__weight="g1", w13="e1"),
    ]
    with DiskWeightSync(fake.url, tmp_path) as sync:
        sync.push(model, 1)
        norm.add_(0.5)  # the trainer changes the norm; the engine keeps its digest while others moved
        fake.replies["/weight_checker"] = _sums(model__norm__weight="n1", mlp__gate__weight="g1", w13="e2")
        with pytest.raises(WeightSyncError, match=r"did not load 1 tensor.*model\.norm\.weight \(dp0:pp0:pcp0:tp0\)"):
            sync.push(model, 2)
        # the failed push is not the baseline: the next is compared with push 1. The norm changed again, and the
        # engine kept every digest: the reload loaded nothing
        fake.replies["/weight_checker"] = _sums(model__norm__weight="n1", mlp__gate__weight="g1", w13="e1")
        norm.add_(0.5)
        with pytest.raises(WeightSyncError, match=r"kept every one of its 3 weight checksums .*model\.norm\.weight"):
            sync.push(model, 3)
        fake.replies["/weight_checker"] = _sums(model__norm__weight="n4", mlp__gate__weight="g1", w13="e2")
        norm.add_(0.5)
        sync.push(model, 4)  # the norm moved as the trainer's did: fine
        fake.replies["/weight_checker"] = _sums(model__norm__weight="n4", mlp__gate__weight="G5", w13="e2")
        with pytest.raises(
            WeightSyncError, match=r"changed 1 tensor\(s\) the trainer pushed byte-identical .*mlp\.gate"
        ):
            sync.push(model, 5)  # the trainer's gate is unchanged, the engine's moved
        # a quantized module (a *scale* beside it) may keep its bytes through a small change
        fake.replies["/weight_checker"] = _sums(
            model__norm__weight="n4", mlp__gate__weight="G5", w13="e6", o_proj__weight="q", o_proj__weight_scale="s"
        )
        sync.push(model, 6)
        model.tensors["o_proj__weight"] = torch.full((8, 8), 2.0)
        fake.replies["/weight_checker"] = _sums(
            model__norm__weight="n4", mlp__gate__weight="G5", w13="e7", o_proj__weight="q", o_proj__weight_scale="s"
        )
        sync.push(model, 7)


def _sha(t: Any) -> str:
    """vLLM's checker's digest of a tensor (SHA-256 of its bytes: ``weight_checksum.compute_tensor_digests``)."""
    from rr_client.integrations._weight_check import _sha256

    return _sha256(t)


def test_the_first_push_is_checked_against_a_baseline_read_before_its_reload(fake: FakeEngine, tmp_path: Path) -> None:
    """The first push has no previous push: the engine's checksums are read before its reload, and a reload that
    kept them all (loaded nothing) fails, unless the engine already held the pushed values (its norm's digest is
    the checkpoint's, as vLLM hashes a parameter's bytes)."""
    torch = pytest.importorskip("torch")
    norm = torch.ones(8)
    model = SafetensorsModel(model__norm__weight=norm, mlp__gate__weight=torch.zeros(4, 8))
    fake.replies["/weight_checker"] = _sums(model__norm__weight="n0", mlp__gate__weight="g0")  # before and after
    with (
        DiskWeightSync(fake.url, tmp_path) as sync,
        pytest.raises(WeightSyncError, match=r"kept every one of its 2 weight checksums through the first push"),
    ):
        sync.push(model, 1)
    checks = [p for m, p in fake.paths(checks=True) if p == "/weight_checker"]
    reload_at = fake.paths(checks=True).index(("POST", "/collective_rpc"))
    assert len(checks) == 2 and fake.paths(checks=True)[0:reload_at].count(("POST", "/weight_checker")) == 1
    # the engine started from the very weights pushed: it holds them (the norm's digest is the checkpoint's)
    fake.replies["/weight_checker"] = _sums(model__norm__weight=_sha(norm), mlp__gate__weight="g0")
    with DiskWeightSync(fake.url, tmp_path / "same") as sync:
        sync.push(model, 1)
        norm.add_(1.0)  # a later push that loaded nothing is still caught against push 1
        with pytest.raises(WeightSyncError, match=r"kept every one of its 2 weight checksums since the last push"):
            sync.push(model, 2)


def test_a_partial_checksum_answer_names_what_is_missing(fake: FakeEngine, tmp_path: Path) -> None:
    """An answer that lost keys since the last one is not another layout: the push fails naming the tensors."""
    torch = pytest.importorskip("torch")
    norm = torch.ones(8)
    model = SafetensorsModel(model__norm__weight=norm, mlp__gate__weight=torch.zeros(4, 8))
    fake.replies["/weight_checker"] = [
        _sums(model__norm__weight="n0", mlp__gate__weight="g0", w13="e0"),
        _sums(model__norm__weight="n1", mlp__gate__weight="g1", w13="e1"),
    ]
    with DiskWeightSync(fake.url, tmp_path) as sync:
        sync.push(model, 1)
        norm.add_(1.0)
        fake.replies["/weight_checker"] = _sums(model__norm__weight="n2", w13="e2")  # the gate's key is gone
        with pytest.raises(WeightSyncError, match=r"partial: 1 tensor\(s\) missing .*mlp\.gate\.weight") as err:
            sync.push(model, 2)
    assert err.value.tensors == ("mlp.gate.weight",) and err.value.engine == fake.url


def test_a_replica_whose_answer_lacks_keys_is_partial_not_another_layout(fake: FakeEngine, tmp_path: Path) -> None:
    """Two replicas of one kind at the same ranks: the one missing a tensor is named; another parallel layout
    (other ranks, the same tensors) is still only compared within itself."""
    port = fake.url.rsplit(":", 1)[1]
    a, b = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    full, short = _sums(model__norm__weight="n1", lm_head__weight="h1"), _sums(model__norm__weight="n1")
    fake.replies["/weight_checker"] = [full, full, full, short]  # baselines, then b's answer after the reload
    with (
        DiskWeightSync([WeightEngine(a, "vllm"), WeightEngine(b, "vllm")], tmp_path) as sync,
        pytest.raises(WeightSyncError, match=r"partial: .*lm_head\.weight \(dp0:pp0:pcp0:tp0\)") as err,
    ):
        sync.push(FakeModel(), 1)
    assert err.value.engine == b
    tp1 = {"checksums": {"dp0:pp0:pcp0:tp1:model.norm.weight": "m", "dp0:pp0:pcp0:tp1:lm_head.weight": "k"}}
    fake.replies["/weight_checker"] = [full, tp1]
    with DiskWeightSync([WeightEngine(a, "vllm"), WeightEngine(b, "vllm")], tmp_path / "two", verify_weights=True) as s:
        s._checksums = {}  # noqa: SLF001 - compare the two answers only
        s._verify(tmp_path)  # noqa: SLF001 - other ranks, same tensors: another layout, no error
