"""SGLang 0.5.23's capture paths that write wrong but well-formed rows, pinned on the release's own code on CPU, and
rr's refusal of them (rr_server.serving.capture_paths) in rr's patched server and the sidecar: ``/rr/info`` and every
sample.

- Speculative tree verification (sgl-project/sglang#37949): the release's ``move_accept_tokens_to_target_kvcache`` and
  its two Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, a subprocess); the capture rows are
  written by the release's ``TopkCaptureOutput.finalize`` and read by its ``BaseTopkCapturer.get_topk``. Only the KV
  pool is a stand-in (a tensor whose ``move_kv_cache`` copies slots, as the release's pools do).
- The fused indexer top-k: the release's ``SGLANG_DSA_FUSE_TOPK`` default and its ``DSATopKBackend.topk_transform``
  dispatch run here; the fused CUDA kernel is a stand-in imitating ``sgl_kernel.fast_topk_transform_fused``'s contract
  (each picked position mapped through ``page_table_size_1``, 0.5.23 dsa_topk_backend.py ``_topk_transform_v2_paged``
  docstring). GPU-only parts not run on a GPU here: docs/engines.md.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rr_client import RRInfo, StaleRoutingError
from rr_server.serving.capture_paths import INDEXER_TOPK, REFUSED_FIELD, ROUTED_EXPERTS, capture_refusal
from rr_server.serving.engines.sglang import FUSE_TOPK_ENV, facts_for, fuse_topk
from tests.sglang.harness import Harness
from tests.support.vllm_process import STARTUP_TIMEOUT_S

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_releases("0.5.23")]  # the release whose code was read
PROMPT = [3, 17, 29, 41, 53, 60, 11, 7, 90]

# One request: prompt in KV slots 1..7, a verify window of 6 draft-tree nodes in slots 10..15; the accepted path is
# nodes 0, 2, 5 (two correct drafts + the bonus). Each node's capture rows and KV are distinct.
TREE_VERIFY = r"""
import json, types, torch
from sglang.srt.speculative import spec_utils
from sglang.srt.state_capturer.base import BaseTopkCapturer, TopkCaptureOutput
window = torch.arange(10, 16, dtype=torch.int64)
rows = (torch.arange(6 * 2 * 2, dtype=torch.int32) + 100).view(6, 2, 2)  # node i's routing rows (2 layers, top-2)
host = types.SimpleNamespace(buffer=torch.zeros(32, 2, 2, dtype=torch.int32))
TopkCaptureOutput(out_cache_loc=window, topk=rows, host_cache=host).finalize()  # the verify forward's capture
before = host.buffer.clone()
kv = torch.zeros(32, dtype=torch.int64)
kv[10:16] = torch.arange(6) + 1000  # node i's KV

class Pool:  # the KV pool's move_kv_cache (memory_pool.py): tgt slots take src slots' KV
    def move_kv_cache(self, tgt, src):
        kv[tgt] = kv[src].clone()

accept = torch.tensor([[0, 2, 5]], dtype=torch.int32)
batch = types.SimpleNamespace(seq_lens=torch.tensor([7]), out_cache_loc=window)
spec_utils.move_accept_tokens_to_target_kvcache(
    batch, accept, torch.tensor([2]), types.SimpleNamespace(get_kvcache=lambda: Pool())
)
# the committed tokens are the window's front slots; rr's rows of them come through get_topk (req_to_token)
pool = types.SimpleNamespace(req_to_token=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 0]]))
got = BaseTopkCapturer.get_topk(types.SimpleNamespace(host_cache=host), 0, 11, pool, start_len=7)
print(json.dumps({
    "kv_front": kv[10:13].tolist(),
    "accepted_kv": (torch.tensor([0, 2, 5]) + 1000).tolist(),
    "rows_got": got.tolist(),
    "rows_accepted": rows[[0, 2, 5]].tolist(),
    "rows_untouched": bool(torch.equal(before, host.buffer)),
}))
"""


def _sglang_env() -> dict[str, str]:
    """This test process's environment (the SGLang overlay on PYTHONPATH) for a subprocess."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_tree_verification_moves_the_kv_but_not_the_capture_rows() -> None:
    """0.5.23's own verification code (kernels in Triton's CPU interpreter) moves the accepted nodes' KV to the
    window's front; the capture rows stay where the verify forward wrote them, so the accepted tokens read nodes
    0, 1, 2's rows instead of 0, 2, 5's: what facts_for("0.5.23").tree_verify_moves_rows states."""
    out = subprocess.run(
        [sys.executable, "-c", TREE_VERIFY],
        env={**_sglang_env(), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kv_front"] == got["accepted_kv"]  # the KV was moved with the accepted path
    assert got["rows_untouched"]  # move_accept_tokens_to_target_kvcache never touches the capture buffer
    moved = got["rows_got"] == got["rows_accepted"]
    assert not moved and got["rows_got"][0] == got["rows_accepted"][0]  # only the root node's row is right
    assert facts_for("0.5.23").tree_verify_moves_rows is moved


def _result_keywords(module: str) -> list[set[str]]:
    """The keyword sets of every ``GenerationBatchResult(...)`` built in ``module``'s source (read, not imported)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    return [
        {k.arg for k in node.keywords if k.arg}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GenerationBatchResult"
    ]


def test_ngram_worker_drops_the_targets_capture_output() -> None:
    """0.5.23's NGRAM worker builds its GenerationBatchResult without the target's routed_experts_output and
    indexer_topk_output (the EAGLE verify passes both): its rows never reach the answer as the target wrote them."""
    from sglang.srt.managers.utils import GenerationBatchResult

    fields = set(GenerationBatchResult.__dataclass_fields__)
    assert {"routed_experts_output", "indexer_topk_output"} <= fields
    ngram = _result_keywords("sglang.srt.speculative.ngram_worker")
    eagle = _result_keywords("sglang.srt.speculative.eagle_worker_common")
    assert ngram and all(not ({"routed_experts_output", "indexer_topk_output"} & kw) for kw in ngram)
    assert any({"routed_experts_output", "indexer_topk_output"} <= kw for kw in eagle)


@pytest.fixture()
def fused_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``SGLANG_DSA_FUSE_TOPK`` unset for the test (each test sets what it needs)."""
    monkeypatch.delenv(FUSE_TOPK_ENV, raising=False)
    yield monkeypatch


def test_fused_topk_default_and_rrs_reading_of_it_match_the_release(fused_env: pytest.MonkeyPatch) -> None:
    """The release's EnvBool default (on) and parse, read by rr's launcher and patch exactly as SGLang reads it."""
    from sglang.srt.environ import envs

    assert envs.SGLANG_DSA_FUSE_TOPK.get() is True and fuse_topk() is True
    for value in ("0", "1", "false", "TRUE", "no", "y"):
        fused_env.setenv(FUSE_TOPK_ENV, value)
        assert envs.SGLANG_DSA_FUSE_TOPK.get() is fuse_topk(), value


def test_only_the_unfused_topk_gives_positions(fused_env: pytest.MonkeyPatch) -> None:
    """The release's topk_transform: with the fused top-k off it runs _topk_unfused, whose picks are token positions
    (each row's top scores among the positions it may read); with it on (the default) it hands the scores and the
    page_size=1 page table to the fused kernel (stand-in), whose picks are KV slots: what capture records on a GPU."""
    import sgl_kernel
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod

    torch.manual_seed(0)
    logits = torch.randn(4, 16)
    lengths = torch.tensor([5, 9, 16, 12], dtype=torch.int32)
    page_table_1 = torch.arange(4 * 16, dtype=torch.int32).view(4, 16) + 4096  # position p of row r -> its KV slot
    meta = types.SimpleNamespace(page_table_1=page_table_1, real_page_table=page_table_1, token_to_batch_idx=None)
    masked = logits.masked_fill(torch.arange(16) >= lengths[:, None], float("-inf"))
    want = torch.topk(masked, 4, dim=-1).indices.to(torch.int32)
    seen: list[torch.Tensor] = []

    def fused_standin(
        score: torch.Tensor,
        lengths: torch.Tensor,
        page_table_size_1: torch.Tensor,
        cu_seqlens_q: Any,
        topk: int,
        row_starts: Any,
    ) -> torch.Tensor:
        """sgl_kernel.fast_topk_transform_fused's contract (CUDA-only): each pick mapped through page_table_size_1."""
        seen.append(page_table_size_1)
        masked = score.masked_fill(torch.arange(score.shape[1]) >= lengths[:, None], float("-inf"))
        return torch.gather(page_table_size_1, 1, torch.topk(masked, topk, dim=-1).indices).to(torch.int32)

    fused_env.setattr(sgl_kernel, "fast_topk_transform_fused", fused_standin, raising=False)
    fused_env.setenv("SGLANG_OPT_USE_TOPK_V2", "0")  # the legacy fused kernel (v2 is a JIT CUDA kernel, same contract)
    fused_env.setenv(FUSE_TOPK_ENV, "0")
    positions = DSATopKBackend.TORCH.topk_transform(logits, lengths, 4, TopkTransformMethod.PAGED, meta)
    assert torch.equal(positions.sort(-1).values, want.sort(-1).values)  # the release's _topk_unfused: positions
    fused_env.delenv(FUSE_TOPK_ENV)  # the release's default: fused
    slots = DSATopKBackend.SGL_KERNEL.topk_transform(logits, lengths, 4, TopkTransformMethod.PAGED, meta)
    assert seen and seen[0] is page_table_1  # the release hands the page table to the fused kernel
    assert torch.equal(slots.sort(-1).values, torch.gather(page_table_1, 1, want.long()).sort(-1).values)
    assert int(slots.min()) >= 4096  # KV slots, never positions: rr would read them as positions
    assert facts_for("0.5.23").indexer_positions_unfused_only is True


def test_fused_topk_without_rr_is_not_positions_on_the_torch_backend(fused_env: pytest.MonkeyPatch) -> None:
    """The torch top-k backend has no fused transform: with the fused switch on (default) the release refuses it,
    so only the unfused switch ever yields positions there too."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod

    meta = types.SimpleNamespace(page_table_1=torch.zeros(1, 4, dtype=torch.int32), token_to_batch_idx=None)
    with pytest.raises(RuntimeError, match="SGLANG_DSA_FUSE_TOPK"):
        DSATopKBackend.TORCH.topk_transform(torch.randn(1, 4), torch.tensor([4]), 2, TopkTransformMethod.PAGED, meta)


# --- rr's refusal in the patched server and the sidecar ----------------------------------------------------------


async def test_patched_server_refuses_rows_of_a_speculative_draft_tree(tiny_moe: Path, patched: None) -> None:
    """rr's patch in a server started without rr's launcher (SGLang's plugin) with NGRAM: /rr/info names the refusal
    and SGLang #37949, and each answer carries the typed refusal instead of rows; EAGLE at top-k 1 is served."""
    h = Harness(tiny_moe, speculative_algorithm="NGRAM")
    async with h.client() as c:
        info = RRInfo.model_validate((await c.get("/rr/info")).json())
    why = (info.model_extra or {})[REFUSED_FIELD][ROUTED_EXPERTS]
    assert "sgl-project/sglang#37949" in why and "--speculative-algorithm NGRAM" in why and "\n" not in why
    assert isinstance(capture_refusal(info, ROUTED_EXPERTS), StaleRoutingError)
    status, out = await h.post(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
    )
    assert status == 200 and out["meta_info"]["routed_experts"] is None
    assert (
        out["meta_info"]["routed_experts_error"].startswith("StaleRoutingError")
        and "#37949" in out["meta_info"]["routed_experts_error"]
    )


async def test_the_sidecar_refuses_rows_of_a_speculative_draft_tree(tiny_moe: Path) -> None:
    """The sidecar reads the upstream's resolved server args (/get_server_info): NGRAM is refused in its /rr/info and
    per sample."""
    from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

    h = Harness(tiny_moe, speculative_algorithm="NGRAM")
    async with sidecar_app(h) as app:
        info = (await client_of(app).get("/rr/info")).json()
        assert "sgl-project/sglang#37949" in info[REFUSED_FIELD][ROUTED_EXPERTS]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
        status, out = await h.post(body, via=client_of(app))
    assert status == 200 and out["meta_info"]["routed_experts"] is None
    assert out["meta_info"]["routed_experts_error"].startswith("StaleRoutingError")


@pytest.fixture()
def gpu_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ServerArgs reads the GPU's compute capability for a DSA model (arg_groups/model_hook.py): stood in as
    an H100's (9, 0), as tests/sglang/test_indexer_sglang.py does."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_a, **_k: (9, 0))


@pytest.fixture(scope="module")
def dsv32(tiny_moe: Path) -> Path:
    from tests.sglang.conftest import CACHE
    from tests.sglang.deepseek_v32 import build_tiny_deepseek_v32

    return build_tiny_deepseek_v32(CACHE / "sglang-deepseek-v32", tokenizer_from=tiny_moe)


async def test_patched_server_refuses_fused_indexer_picks(
    dsv32: Path, patched: None, gpu_capability: None, fused_env: pytest.MonkeyPatch
) -> None:
    """With indexer capture and SGLang's fused top-k on (its default), rr's patch says the picks are not positions
    and refuses each sample's (IndexerPositionError), keeping the routing; with SGLANG_DSA_FUSE_TOPK=0 (what rr's
    launcher sets) the picks are positions and served."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 3},
        "return_indexer_topk": True,
        "return_routed_experts": True,
    }
    h = Harness(dsv32, enable_return_indexer_topk=True)
    async with h.client() as c:
        info = (await c.get("/rr/info")).json()
    assert info["indexer_positions"] is False and FUSE_TOPK_ENV in info[REFUSED_FIELD][INDEXER_TOPK]
    status, out = await h.post(body)
    assert status == 200 and out["meta_info"]["indexer_topk"] is None
    assert out["meta_info"]["indexer_topk_error"].startswith("IndexerPositionError")
    assert out["meta_info"]["routed_experts"] is not None
    fused_env.setenv(FUSE_TOPK_ENV, "0")
    h = Harness(dsv32, enable_return_indexer_topk=True)
    async with h.client() as c:
        info = (await c.get("/rr/info")).json()
    assert info["indexer_positions"] is True and info[REFUSED_FIELD] is None
    status, out = await h.post({**body, "indexer_topk_format": "npy"})
    assert status == 200 and "indexer_topk_error" not in out["meta_info"] and out["meta_info"]["indexer_topk"]


async def test_the_sidecar_refuses_indexer_picks_it_cannot_tell_are_positions(
    dsv32: Path, gpu_capability: None, fused_env: pytest.MonkeyPatch
) -> None:
    """The upstream's SGLANG_DSA_FUSE_TOPK is not in its server info: the sidecar says "unknown" (null) and refuses
    indexer picks of an upstream with indexer capture on, whatever the upstream runs."""
    from tests.sglang.test_sidecar_sglang import client_of, sidecar_app

    fused_env.setenv(FUSE_TOPK_ENV, "0")  # even an upstream that runs unfused: the sidecar cannot see it
    h = Harness(dsv32, enable_return_indexer_topk=True)
    async with sidecar_app(h) as app:
        info = (await client_of(app).get("/rr/info")).json()
        assert info["indexer_positions"] is None and "cannot be seen" in info[REFUSED_FIELD][INDEXER_TOPK]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_indexer_topk": True}
        status, out = await h.post(body, via=client_of(app))
    assert status == 200 and out["meta_info"]["indexer_topk"] is None
    assert out["meta_info"]["indexer_topk_error"].startswith("IndexerPositionError")
