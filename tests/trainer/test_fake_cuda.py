"""Device correctness on a CPU: replay's router hook, the audit's hooks, the record, the layouts, the metrics and
verl's row layout driven with fake CUDA tensors (PyTorch's FakeTensorMode; tests/support/fake_cuda.py).

A CPU-made tensor meeting a CUDA one anywhere in these paths raises FakeTensorDeviceMismatchError, as the
documented ``replay_routing(model, gpu_rows)`` call did on a real GPU (its default mask was made on the CPU).
What needs the data (the one host read of a block) runs on real CPU tensors before the fake part.
"""

from __future__ import annotations

import pytest
import torch

from rr_client import to_packed, to_tensors
from rr_client.integrations.verl._rows import padded_rows
from rr_client.trainer.metrics import gap_stats
from rr_client.trainer.replay import RoutingRecord, survey
from rr_client.trainer.replay._audit import Audit, DeviceTally
from rr_client.trainer.replay._replay import ReplayHook
from rr_client.trainer.replay._routers import num_hidden_layers
from rr_client.trainer.replay._rows import place_rows, readers_of
from rr_client.trainer.rows import ReplayRows
from tests.support.fake_cuda import CUDA, FakeTensorDeviceMismatchError, fake_mode, on_cuda, to_fake_cuda
from tests.trainer.test_layouts import info as layout_info
from tests.trainer.test_layouts import sample as layout_sample
from tests.trainer.tiny_models import ARCHS, EXPERTS, TOPK, tiny_model

B, T = 2, 6
N = B * T


def _rows(n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real CPU rows ``[N, L, K]`` int16 (distinct ids per row) and a CPU mask with some rows left out."""
    base = (torch.arange(N)[:, None, None] + torch.arange(n_layers)[None, :, None]) % EXPERTS
    ids = ((base + torch.arange(TOPK)[None, None, :]) % EXPERTS).to(torch.int16)
    mask = torch.ones(N, dtype=torch.bool)
    mask[T - 1 :: T] = False  # each sample's last token: no routing
    return ids, mask


def _router_out(r, mode):  # noqa: ANN001, ANN202 - test helper
    with mode:
        logits = torch.randn(N, r.num_experts, device=CUDA)
        weights = torch.rand(N, r.top_k, device=CUDA)
        own = torch.randint(0, r.num_experts, (N, r.top_k), device=CUDA)
    return logits, weights, own


def _drive(model, rows, mode, routers, left) -> DeviceTally:  # noqa: ANN001
    """Run replay's router hook (formula check on) and the audit's experts hook for every router on fake CUDA."""
    tally = DeviceTally()
    aud = Audit(routers, left, rows, tally)
    hook = ReplayHook(rows, tally, aud, {}, 1, ckpt=False)
    with mode:
        for r in routers:
            out = hook(r, _router_out(r, mode))
            assert on_cuda(out), f"layer {r.layer}: replay hook output left the GPU"
            h = torch.randn(N, 32, device=CUDA)
            aud.on_experts(r, (h, out[2], out[1]), {})  # the same tensor: proven without ops
            out = hook(r, _router_out(r, mode))
            aud.on_experts(r, (h, out[2].clone(), out[1]), {})  # another tensor: compared on the device
    assert tally and all(t.device == CUDA for parts in tally._parts.values() for t in parts)
    assert aud.bad_experts == {}
    return tally


def test_harness_catches_a_cpu_tensor_meeting_a_gpu_one() -> None:
    """Negative control: the old default mask (``torch.ones(n_rows)`` on the CPU) against GPU ids raises here."""
    mode = fake_mode()
    with mode:
        ids = torch.randint(0, 8, (N, 2), device=CUDA)
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.ones(N, dtype=torch.bool) & (ids >= 0).all(dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_and_audit_hooks_with_cpu_rows(arch: str) -> None:
    """CPU rows and mask (as to_tensors makes them), model on the GPU: validated on the CPU, placed on the GPU
    once, and the hooks never touch a CPU tensor."""
    mode = fake_mode()
    model = to_fake_cuda(tiny_model(arch), mode)
    routers, left = survey(model)
    ids, mask = _rows(num_hidden_layers(model, routers))
    given = ReplayRows.of(
        ids, mask=mask, num_hidden_layers=num_hidden_layers(model, routers), moe_layers=[r.layer for r in routers]
    )
    readers = readers_of(routers)
    spare = [layer for p, layer in enumerate(given.layers) if p not in set(given.positions(readers))]
    st, n_use, unconsumed = given.check(readers, spare=spare)  # real CPU: the one host read happens here
    assert n_use == [N - B] * len(routers)
    with mode:
        rows = place_rows(st, n_use, unconsumed, routers, audit=True)
    for lr in rows.layers.values():
        assert on_cuda(lr.ids, lr.use, lr.ids_sorted)
    _drive(model, rows, mode, routers, left)


@pytest.mark.parametrize("arch", [a for a in ("qwen3_moe", "deepseek_v3") if a in ARCHS])  # 5.10 refuses deepseek_v3
def test_replay_and_audit_hooks_with_gpu_rows_and_cpu_mask(arch: str) -> None:
    """GPU rows (verl's micro-batch) with a CPU mask: the mask moves to the rows, validation stays on the GPU."""
    mode = fake_mode()
    model = to_fake_cuda(tiny_model(arch), mode)
    routers, left = survey(model)
    ids, mask = _rows(num_hidden_layers(model, routers))
    axis = dict(num_hidden_layers=num_hidden_layers(model, routers), moe_layers=[r.layer for r in routers])
    with mode:
        st = ReplayRows.of(ids.to(CUDA), mask=mask, **axis).stats(readers_of(routers))
    assert on_cuda(st.sel, st.srt, st.use, st.stats)
    # placing GPU rows on the GPU is a no-op transfer; FakeTensorMode on a CPU build cannot run the layer-major
    # ``contiguous()`` copy of a fake CUDA tensor, so the hooks are driven with rows validated on the CPU
    st, n_use, _ = ReplayRows.of(ids, mask=mask, **axis).check(readers_of(routers))
    with mode:
        rows = place_rows(st, n_use, [], routers, audit=True)
    _drive(model, rows, mode, routers, left)


def test_record_assembles_on_the_gpu_and_moves_once() -> None:
    mode = fake_mode()
    with mode:
        rec = RoutingRecord(
            num_hidden_layers=3,
            moe_layers=[0, 2],
            topk=2,
            shape=(B, T),
            _layers={0: torch.randint(0, 8, (N, 2), device=CUDA), 2: torch.randint(0, 8, (N, 2), device=CUDA)},
        )
        kept = rec.tensor(None)
        moved = rec.routed_experts
    assert kept.device == CUDA and tuple(kept.shape) == (B, T, 3, 2)
    assert moved.device.type == "cpu" and tuple(moved.shape) == (B, T, 3, 2)


def test_layouts_move_once_and_feed_replay_on_the_gpu() -> None:
    samples = [layout_sample(0, 3, 4), layout_sample(1, 2, 5)]
    rt, packed = to_tensors(samples, layout_info()), to_packed(samples, layout_info())
    mode = fake_mode()
    with mode:
        for batch in (rt.to(CUDA), packed.to(CUDA)):
            assert on_cuda(*[v for v in vars(batch).values() if isinstance(v, torch.Tensor)])
        on_gpu = rt.to(CUDA).routed_experts
        flat = on_gpu.reshape(-1, *on_gpu.shape[-2:]).long()
        # the CPU mask of the CPU layout meets GPU rows: moved, not mixed
        m = rt.routed_experts_mask.reshape(-1).to(flat.device)
        assert on_cuda((flat >= 0).all(-1).all(-1) & m)


def test_metrics_on_the_gpu_with_a_cpu_mask() -> None:
    mode = fake_mode()
    with mode:
        lt = torch.randn(B, T, device=CUDA)  # the trainer's log-probs on the GPU
        stats = gap_stats(lt, torch.zeros(B, T), torch.ones(B, T, dtype=torch.bool))  # rollout and mask on CPU
    assert stats.device == CUDA and tuple(stats.shape) == (7,)


def test_verl_padded_rows_on_the_gpu() -> None:
    mode = fake_mode()
    offsets = torch.tensor([0, 4, 9])  # verl's jagged offsets, on the CPU
    with mode:
        rows = torch.randint(0, 8, (9, 3, 2), device=CUDA)
        mask = torch.ones(9, dtype=torch.bool, device=CUDA)
        dense, dmask = padded_rows(rows, mask, offsets, 7)
    assert on_cuda(dense, dmask) and tuple(dense.shape) == (2, 7, 3, 2) and tuple(dmask.shape) == (2, 7)


def test_verl_padded_rows_places_rows_under_their_tokens() -> None:
    """The same function on real tensors: each sample's rows at columns 0..len-1, zeros and False after."""
    offsets = torch.tensor([0, 2, 5])
    rows = torch.arange(5 * 1 * 2).reshape(5, 1, 2)
    mask = torch.tensor([True, False, True, True, False])
    dense, dmask = padded_rows(rows, mask, offsets, 4)
    assert torch.equal(dense[0, :2], rows[:2]) and torch.equal(dense[1, :3], rows[2:])
    assert not dense[0, 2:].any() and not dense[1, 3:].any()
    assert dmask.tolist() == [[True, False, False, False], [True, True, False, False]]


def test_megatron_recompute_pool_on_the_gpu_copies_and_reads_nothing() -> None:
    """Megatron's recompute pool (rr_client.integrations.megatron._recompute) on fake CUDA at steady state: forwards
    into free slots and recomputes out of order (F4 before F2's recompute) copy nothing between host and device
    and read nothing (a ``torch.tensor(i, device=...)`` per forward was one blocking upload each)."""
    from rr_client.integrations.megatron._recompute import RecomputePool
    from rr_client.trainer.replay.cost import count_ops
    from rr_client.trainer.replay.phase import DeviceTally

    mode = fake_mode()
    with mode:
        hidden = [torch.randn(T, B, 32, device=CUDA) for _ in range(4)]
        rows = [torch.randint(0, EXPERTS, (N, TOPK), device=CUDA) for _ in range(4)]
        have = torch.ones(N, dtype=torch.bool, device=CUDA)
        pool = RecomputePool("decoder layer 1")
        pool.add(rows[0], have, hidden[0])  # warm-up: the fingerprint's projection is uploaded once per device
        pool.take(hidden[0], N)
        with count_ops() as counted:
            for i in (1, 2, 3):
                pool.add(rows[i], have, hidden[i])
            taken = [pool.take(hidden[i], N) for i in (3, 1, 2)]
            pool.verdicts(DeviceTally(), "recompute/1")
    assert counted.syncs == 0 and counted.copies == 0, (counted.sync_names, counted.copy_names)
    assert all(on_cuda(*pair) for pair in taken)
    assert pool.groups[N].fps.n == 3  # the first forward's slot was reused
