"""How the patch gets in: version/shape checks, idempotency, SGLang's plugin system, the launcher, /rr/info."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rr_client.core.codec import check_routing, decode_meta_info, routing_meta_fields
from rr_client.core.errors import (
    ExpertIdOutOfRangeError,
    MalformedPayloadError,
    ShapeMismatchError,
    UnrecordedRoutingError,
)
from rr_client.core.info import RRInfo
from rr_server.serving.engines.sglang import UnsupportedSGLangError, profile_for
from tests.sglang.conftest import MODEL_SPEC
from tests.sglang.harness import Harness

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("version", ["0.5.6", "0.5.24", "0.6.0", "0.4.10", "garbage"])
def test_unknown_versions_are_refused(version: str) -> None:
    """Outside 0.5.7-0.5.23 the patch refuses instead of patching blind."""
    with pytest.raises(UnsupportedSGLangError):
        profile_for(version)


@pytest.mark.parametrize(
    "version,field,is_async,start",
    [
        ("0.5.7", "output_routed_experts", False, False),
        ("0.5.9", "routed_experts", False, False),
        ("0.5.10.post1", "routed_experts", False, False),
        ("0.5.11", "routed_experts", True, False),
        ("0.5.12", "routed_experts", True, True),
        ("0.5.23", "routed_experts", True, True),
    ],
)
def test_profiles(version: str, field: str, is_async: bool, start: bool) -> None:
    """Per-version facts the hooks rely on."""
    p = profile_for(version)
    assert (p.field, p.handle_is_async, p.honours_start) == (field, is_async, start)


def test_installed_version_matches_its_code() -> None:
    """The installed SGLang's functions and io_struct fields have the shape its profile claims."""
    from rr_patches.sglang.apply import check_sglang_shapes

    check_sglang_shapes(profile_for())


def test_wrong_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A _handle_batch_output with an unexpected signature makes the patch refuse."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from rr_patches.sglang.apply import apply

    def _handle_batch_output(self: Any, recv_obj: Any, extra: Any) -> None:  # not SGLang's shape
        return None

    monkeypatch.setattr(TokenizerManager, "_handle_batch_output", _handle_batch_output)
    with pytest.raises(
        UnsupportedSGLangError,
        match=r"TokenizerManager\._handle_batch_output\(self, recv_obj, extra\) "
        r"does not have the shape rr relies on \(self, recv_obj\)",
    ) as exc:
        apply()
    assert f" in SGLang {profile_for().version}: " in str(exc.value)
    assert exc.value.package == "sglang" and exc.value.version == profile_for().version


def test_apply_is_idempotent(patched: None) -> None:
    """Applying twice wraps once."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from rr_patches.sglang.apply import apply, is_applied

    before = TokenizerManager.__dict__["_handle_batch_output"]
    apply()
    assert is_applied() and TokenizerManager.__dict__["_handle_batch_output"] is before


def test_entry_point_is_declared() -> None:
    """SGLang's plugin loader finds rr through the ``sglang.srt.plugins`` entry point group."""
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("rr") == "rr_patches.sglang.plugin:register"


def test_plugin_register(tiny_moe: Path) -> None:
    """0.5.11+: HookRegistry AROUND hooks via SGLang's own load_plugins(); before: a direct patch."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    import rr_patches.sglang.plugin as plugin
    from rr_patches.sglang.apply import TARGETS, TM_PATH, is_applied

    saved = {name: TokenizerManager.__dict__[name] for name in TARGETS}
    plugin._registered = False
    try:
        if profile_for().has_plugins:
            import sglang.srt.plugins as sp
            from sglang.srt.plugins.hook_registry import HookRegistry

            monkey = pytest.MonkeyPatch()
            monkey.setenv("SGLANG_PLUGINS", "rr")
            monkey.setattr(sp, "_plugins_loaded", False)
            try:
                sp.load_plugins()  # discovers the entry point, runs register(), applies hooks
            finally:
                monkey.undo()
            assert {f"{TM_PATH}.{n}" for n in TARGETS} <= HookRegistry._patched
        else:
            plugin.register()
        assert is_applied()
        h = Harness(tiny_moe, skip_tokenizer_init=True)  # the hooked class still constructs and serves
        from rr_patches.sglang.state import state_of

        info = state_of(h.tm).info  # built by the hooked __init__ from the served model's config
        assert info is not None and info.engine == "sglang" and info.engine_version == profile_for().version
        assert (info.num_hidden_layers, info.num_experts, info.topk, info.moe_layers) == (3, 8, 2, [0, 2])
    finally:
        for name, fn in saved.items():
            setattr(TokenizerManager, name, fn)
        plugin._registered = False
        if profile_for().has_plugins:
            from sglang.srt.plugins.hook_registry import HookRegistry

            HookRegistry.reset()


async def test_rr_info_route(tiny_moe: Path, patched: None) -> None:
    """``GET /rr/info`` on SGLang's own app describes the served model."""
    h = Harness(tiny_moe)
    transport = httpx.ASGITransport(app=h.http.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as client:
        resp = await client.get("/rr/info")
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["engine"] == "sglang" and info["engine_version"] == profile_for().version
    assert (info["num_hidden_layers"], info["num_experts"], info["topk"]) == (3, 8, 2)
    assert info["moe_layers"] == [0, 2] and info["wire_dtype"] == "uint8"
    assert info["logprobs_mode"] == "processed"  # SGLang's sampled log-probs are after temperature by default


def test_launcher_adds_flag_and_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rr-server launch sglang`` adds the flag, patches, and hands SGLang's own parser the arguments."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    import rr_server.launch.sglang as ls
    from rr_patches.sglang.apply import TARGETS, is_applied

    seen: list[list[str]] = []
    monkeypatch.setattr(ls, "_run", lambda argv: seen.append(argv))
    saved = {name: TokenizerManager.__dict__[name] for name in TARGETS}
    try:
        assert ls.main(["--model-path", "M", "--port", "1234"]) == 0
        assert is_applied()
    finally:
        for name, fn in saved.items():
            setattr(TokenizerManager, name, fn)
        if profile_for().has_plugins:
            from sglang.srt.plugins.hook_registry import HookRegistry

            HookRegistry.reset()
    assert seen == [["--model-path", "M", "--port", "1234", "--enable-return-routed-experts"]]
    assert ls.main(["--model-path", "M", "--tokenizer-worker-num", "2"]) == 2


def test_launcher_refuses_unknown_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """An untested SGLang makes the launcher exit 2 before anything starts."""
    import rr_server.launch.sglang as ls

    monkeypatch.setattr("rr_server.serving.engines.sglang.installed_version", lambda: "0.5.99")
    monkeypatch.setattr(ls, "_run", lambda argv: pytest.fail("must not start"))
    assert ls.main(["--model-path", "M"]) == 2


def _spec_info() -> RRInfo:
    """RRInfo of the tiny test model (3 layers, layer 1 dense, 8 experts, top-2), from its config fields."""
    cfg = {
        "num_hidden_layers": MODEL_SPEC["num_layers"],
        "num_experts": MODEL_SPEC["num_experts"],
        "num_experts_per_tok": MODEL_SPEC["topk"],
        "mlp_only_layers": list(MODEL_SPEC["mlp_only_layers"]),
    }
    return RRInfo.from_hf_config(cfg, engine="sglang", engine_version=profile_for().version)


def test_wire_fields_refusals() -> None:
    """Every payload that cannot be trusted raises its typed error instead of being forwarded."""
    import pybase64
    import torch

    from rr_patches.sglang.convert import wire_fields

    info = _spec_info()
    good = np.array([[[1, 2], [0, 0], [3, 4]], [[5, 6], [0, 0], [7, 1]]] * 2, dtype=np.int32)  # 4 rows
    fields = wire_fields(torch.from_numpy(good), info, rows=4)
    assert fields == routing_meta_fields(check_routing(good, info, rows=4))
    assert fields["routed_experts_dtype"] == info.wire_dtype == "uint8"
    np.testing.assert_array_equal(
        decode_meta_info(fields, rows=4, num_layers=3, topk=2, num_experts=8, moe_layers=info.moe_layers), good
    )
    b64 = pybase64.b64encode(good.tobytes()).decode()  # 0.5.11+ detokenizer output: base64 headerless int32
    assert wire_fields(b64, info, rows=4) == fields
    assert wire_fields(b64.encode(), info, rows=4) == fields  # bytes too
    # SGLang < 0.5.12 ignores routed_experts_start_len: rr drops the leading rows itself
    sliced = wire_fields(b64, info, rows=3, start=1, slice_start=True)
    assert sliced == routing_meta_fields(check_routing(good[1:], info, rows=3, start=1))
    assert sliced["routed_experts_start"] == 1 and sliced["routed_experts_shape"] == [3, 3, 2]
    # 0.5.12+ already sliced: the rows arrive as they are and only the start is stated
    assert wire_fields(good[1:], info, rows=3, start=1) == sliced
    with pytest.raises(ShapeMismatchError):
        wire_fields(pybase64.b64encode(good.tobytes()[:-8]).decode(), info, rows=4)  # not a whole number of rows
    with pytest.raises(ShapeMismatchError, match="4 rows, expected 5"):
        wire_fields(b64, info, rows=5)
    with pytest.raises(MalformedPayloadError):
        wire_fields("not base64!", info, rows=4)
    with pytest.raises(MalformedPayloadError):
        wire_fields(torch.zeros(2, 3, 2), info, rows=2)  # float
    with pytest.raises(ExpertIdOutOfRangeError):
        wire_fields(torch.full((2, 3, 2), 8, dtype=torch.int32), info, rows=2)
    with pytest.raises(ShapeMismatchError):
        wire_fields(b64, info, rows=0, start=9, slice_start=True)
    with pytest.raises(ShapeMismatchError):
        wire_fields(torch.zeros(2, 4, 2, dtype=torch.int32), info, rows=2)  # wrong layer count
    with pytest.raises(UnrecordedRoutingError, match="all-zero"):
        wire_fields(torch.zeros(2, 3, 2, dtype=torch.int32), info, rows=2)  # nothing recorded
    bad_dense = good.copy()
    bad_dense[0, 1] = [1, 2]
    with pytest.raises(ShapeMismatchError, match="dense layer"):
        wire_fields(bad_dense, info, rows=4)
