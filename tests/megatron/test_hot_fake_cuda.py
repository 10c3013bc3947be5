"""Megatron's hot path on fake CUDA tensors (PyTorch's FakeTensorMode; tests/support/fake_cuda.py): the feed's
uploads, and every router call of a step (forwards with the audit, recomputes out of order) through rr's hooks on a
real megatron-core 0.16.1 ``TopKRouter`` whose weights live on the fake GPU.

On a CPU a host read or an upload is invisible (the tensors already live there); with fake CUDA tensors the op
counter (rr_client.trainer.replay.cost) sees every copy between host and device and every host read. The feed's own
row check reads the rows on the host once by design (the rows are real CPU tensors); only its uploads run in the
fake mode. A recompute is marked as one by patching the lifecycle's ``in_backward`` (fake CUDA autograd needs a
CUDA device guard a CPU build lacks), the stand-in for Megatron's checkpoint backward.
"""

from __future__ import annotations

import pytest
import torch

from rr_client.trainer.replay.cost import count_ops
from tests.megatron import harness as H
from tests.support.fake_cuda import CUDA, fake_mode, on_cuda, to_fake_cuda

B, S, E, TOPK = 2, 6, 8, 2
PATTERN = (0, 1, 1)
LAYERS = [0, 1, 2]


def test_router_calls_on_the_gpu_copy_and_read_nothing(megatron_process: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each micro-batch's feed uploads its targets (and ``have``) without blocking; then every router call of the
    step, the forwards under the audit and the recomputes in reverse order, copies nothing between host and device
    and reads nothing from it."""
    from rr_client.integrations.megatron import MegatronReplay, _feeder, _lifecycle

    H.new_model_state()
    mode = fake_mode()
    model = to_fake_cuda(H.build_gpt(H.ModelSpec(moe_pattern=PATTERN, recompute=True)), mode)
    real_upload = _feeder.upload

    def upload_on_the_fake_gpu(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        with mode:
            return real_upload(t, device)

    monkeypatch.setattr(_feeder, "upload", upload_on_the_fake_gpu)
    replay = MegatronReplay(model, audit_every=1)
    routers = H.routers(model)
    with mode:
        hidden = [torch.randn(S, B, H.HIDDEN, device=CUDA) for _ in range(2)]
    calls = []
    for mb in range(2):
        with count_ops() as fed:
            got = replay.set_micro_batch(H.random_rows(B, S, len(LAYERS), E, TOPK, seed=mb), layers=LAYERS)
        assert on_cuda(got.have, *got.targets.values())
        assert fed.copies >= 1 and not [k for k in fed.sync_names if "->cuda" in k], fed.sync_names
        with mode, count_ops() as forward:
            for r in routers:
                r(hidden[mb])
        calls.append(forward)
    monkeypatch.setattr(_lifecycle, "in_backward", lambda: True)
    for mb in (1, 0):
        with mode, count_ops() as recompute:
            for r in routers:
                r(hidden[mb])
        calls.append(recompute)
    assert calls[0].copies <= 1  # the fingerprint's projection, uploaded once per process and device, non-blocking
    for c in calls:
        assert c.syncs == 0, c.sync_names
    for c in calls[1:]:
        assert c.copies == 0, c.copy_names
    assert all(st.recomputes == 2 for st in replay.lifecycle.states.values())
    replay.lifecycle.remove()
    H.new_model_state()


def test_uploads_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a CUDA device is present, a host tensor is pinned before its non-blocking upload (CUDA synchronizes the
    stream for an upload from pageable memory); a tensor already on the device is not copied."""
    from rr_client.integrations.megatron._feeder import upload

    pinned = []

    def pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t)
        return t

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    host = torch.arange(6)
    out = upload(host, torch.device("meta"))  # a device this CPU build has: the path a GPU takes
    assert out.device.type == "meta" and len(pinned) == 1 and pinned[0] is host
    assert upload(out, torch.device("meta")) is out and len(pinned) == 1


def test_pads_number_on_across_micro_batches(megatron_process: None) -> None:
    """A step of micro-batches with few pads each (one sample's last token): over the step, pad tokens per expert
    are within one of even (each micro-batch's ordinals restarted at 0, so every micro-batch's pad went to the
    same experts)."""
    from rr_client.integrations.megatron import MegatronReplay

    H.new_model_state()
    model = H.build_gpt(H.ModelSpec(moe_pattern=PATTERN))
    replay = MegatronReplay(model)
    pads: dict[int, torch.Tensor] = {}
    mask = torch.ones(1, S, dtype=torch.bool)
    mask[:, -1] = False  # the sample's last token: no row, a pad
    for mb in range(2 * E):
        rows = H.random_rows(1, S, len(LAYERS), E, TOPK, seed=mb)
        got = replay.targets_for(rows, layers=LAYERS, mask=mask)
        for r in replay.routers:
            counts = torch.bincount(got.targets[r.module][~got.have].flatten(), minlength=E)
            pads[r.layer_number] = pads.get(r.layer_number, torch.zeros(E, dtype=torch.long)) + counts
    for layer, counts in pads.items():
        assert int(counts.sum()) == 2 * E * TOPK
        assert int(counts.max() - counts.min()) <= 1, f"layer {layer}: pad tokens per expert {counts.tolist()}"
    replay.close()
