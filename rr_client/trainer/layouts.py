"""Pad per-sample routing into trainer-ready torch tensors, aligned token-for-token with ``input_ids``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, Protocol, Self

import numpy as np

from rr_client.core.errors import (
    ConfigurationError,
    IndexerPositionError,
    MissingDependencyError,
    MissingRoutingError,
    ShapeMismatchError,
)
from rr_client.core.info import RRInfo

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("rr_client.to_tensors needs torch: pip install 'rr-replay[torch]'") from e

from rr_client.trainer.rows import axis_layers, pad_ids

__all__ = ["PackedRouting", "RoutingTensors", "Sample", "to_packed", "to_tensors", "tensor_dtype"]


class Sample(Protocol):
    """What padding needs of one sample (a :class:`rr_client.GenerateResult` or :class:`rr_client.Trajectory`).

    An optional ``output_loss_mask`` (one bool per output token) becomes ``response_mask``; without it
    every output token is a response token.
    """

    @property
    def index(self) -> int: ...
    @property
    def prompt_ids(self) -> list[int] | None: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def routed_experts(self) -> np.ndarray | None: ...
    @property
    def routed_experts_start(self) -> int: ...


def _routing_of(sample: Sample) -> np.ndarray:
    """The sample's routing, or a typed error saying it was not requested/received."""
    if sample.routed_experts is None:
        raise MissingRoutingError(f"sample {sample.index} has no routing (generated with return_routed_experts=False)")
    return sample.routed_experts


class _Layout:
    """What both layouts' dataclasses offer: one move to a device, a plain dict."""

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Self:
        """The same batch with every tensor on ``device``, moved once per batch (replay then moves nothing)."""
        obj: Any = self
        return replace(
            obj,
            **{
                f.name: getattr(obj, f.name).to(device, non_blocking=non_blocking)
                for f in fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor)
            },
        )

    def as_dict(self) -> dict[str, object]:
        """Plain dict, e.g. to merge into a trainer's batch."""
        obj: Any = self
        return asdict(obj)


PadExperts = Literal["zero", "distinct", "minus_one"]
LayerAxis = Literal["absolute", "moe"]


@dataclass(frozen=True)
class RoutingTensors(_Layout):
    """Padded batch. ``routed_experts[b, t]`` is the routing that produced token ``t + 1`` of sample ``b``.

    Shapes: ``input_ids``, ``attention_mask``, ``response_mask``, ``routed_experts_mask``: ``[B, T]``;
    ``routed_experts``: ``[B, T, L, K]`` (token-major) or ``[L, B, T, K]`` (layer-major). Rows where
    ``routed_experts_mask`` is False (padding, the last token of each sample, which has no routing, and
    tokens before ``routed_experts_start``) hold the pad value of ``pad_experts``. ``layers[i]`` is the
    absolute decoder layer of position ``i`` of the layer axis; ``layer_axis`` says whether that axis is
    every decoder layer (``"absolute"``) or the MoE layers only (``"moe"``, Megatron's router ordinals).
    ``logprobs`` (``[B, T]`` float32, when the samples carry the engine's sampled log-probs): ``logprobs[b, t]``
    is token ``t``'s, NaN outside the completion and where the engine gave none; ``logprobs_mode`` says what
    they mean (:mod:`rr_client.core.logprobs`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    routed_experts: torch.Tensor
    routed_experts_mask: torch.Tensor
    layers: list[int]
    layer_axis: LayerAxis = "absolute"
    position_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    logprobs_mode: str | None = None
    #: per sample, per turn: the provenance of its rows (None where the server gave none), for the stale-rows
    #: policy a :class:`rr_client.trainer.ReplaySession` applies where the rows enter (None: not known)
    provenance: tuple[tuple[Any, ...], ...] | None = None
    #: ``[B, T, indexer layers, index_topk]`` when the samples carry sparse-attention indexer picks
    #: (``return_indexer_topk``): row ``[b, t]`` holds the batch columns token ``t`` reads (the engine's sequence
    #: positions moved to where the padding put them), ``-1`` where the model keeps its own pick (tokens that read
    #: every earlier token, padding); int16 up to 32,767 columns, else int32. Replayed beside the routing by
    #: :class:`rr_client.trainer.ReplaySession` (:func:`rr_client.trainer.replay_indexer`)
    indexer_topk: torch.Tensor | None = None
    indexer_layers: list[int] | None = None  #: the decoder layers of ``indexer_topk``'s layer axis (the server's)


@dataclass(frozen=True)
class PackedRouting(_Layout):
    """Packed (THD) batch: every sample's tokens concatenated, no padding between samples.

    ``input_ids``, ``position_ids`` (0-based per sample), ``response_mask``, ``routed_experts_mask``:
    ``[N]``; ``cu_seqlens``: ``[B+1]`` int32 sample boundaries over the real tokens (``cu_seqlens[-1]`` is
    the real token count; tokens after it, if ``pad_to_multiple_of`` added any, belong to no sample).
    ``routed_experts``: ``[N, L, K]`` with ``append_row=True`` (row ``n`` is token ``n``'s routing; each
    sample's last token holds an appended, masked placeholder row), or ``[N - B, L, K]`` with
    ``append_row=False`` (each sample's ``len - 1`` rows, as engines return them; ``routing_cu_seqlens``
    gives their boundaries and ``routed_experts_mask`` then has the rows' length). ``logprobs``: ``[N]``
    float32 beside ``input_ids`` as in :class:`RoutingTensors` (None when the samples carry none).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    response_mask: torch.Tensor
    routed_experts: torch.Tensor
    routed_experts_mask: torch.Tensor
    routing_cu_seqlens: torch.Tensor
    layers: list[int]
    layer_axis: LayerAxis = "absolute"
    num_pad_tokens: int = 0
    logprobs: torch.Tensor | None = None
    logprobs_mode: str | None = None
    provenance: tuple[tuple[Any, ...], ...] | None = None  #: per sample, per turn, as in :class:`RoutingTensors`


def tensor_dtype(num_experts: int) -> np.dtype[np.generic]:
    """uint8 up to 256 experts; int16 above (torch has few uint16 kernels), up to 32768."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise ConfigurationError(f"num_experts={num_experts} does not fit int16 expert ids")


def _routing_dtype(num_experts: int, pad_experts: str) -> np.dtype[np.generic]:
    """tensor_dtype, widened to a signed type when pads are -1."""
    dt = tensor_dtype(num_experts)
    if pad_experts == "minus_one" and dt == np.uint8:
        return np.dtype(np.int16)
    return dt


def _pad_row(pad_experts: str, n_layers: int, k: int) -> np.ndarray | None:
    """The ``[L, K]`` row the buffer starts with where there is no routing, or None for zeros (the buffer's
    fill; ``"distinct"`` pads are written after the rows, by :func:`_spread_pads`)."""
    if pad_experts in ("zero", "distinct"):
        return None
    if pad_experts == "minus_one":
        return np.full((n_layers, k), -1)
    raise ConfigurationError(f"pad_experts must be 'zero', 'distinct' or 'minus_one', got {pad_experts!r}")


def _spread_pads(routing: np.ndarray, have: np.ndarray, layers: list[int], num_experts: int) -> None:
    """``pad_experts="distinct"``: every row without routing (``have`` False) gets the rows' pad row for its pad
    ordinal (row-major order) and layer (:func:`rr_client.trainer.rows.pad_ids`: K distinct ids strided over all
    experts, rotated per layer), in place, vectorised."""
    free = ~have
    if not free.any():
        return
    ordinal = np.cumsum(free.ravel()).reshape(free.shape)[free] - 1
    routing[free] = pad_ids(torch.from_numpy(ordinal), layers, routing.shape[-1], num_experts).numpy()


def _provenances(results: Sequence[Sample]) -> tuple[tuple[Any, ...], ...]:
    """Each sample's provenance per turn (:func:`rr_client.trainer.provenance.sample_provenances`), carried with the
    rows so the stale-rows policy runs where they enter a session."""
    from rr_client.trainer.provenance import sample_provenances

    return tuple(tuple(sample_provenances(r)) for r in results)


def _sequences(results: Sequence[Sample]) -> list[tuple[list[int], list[int]]]:
    seqs: list[tuple[list[int], list[int]]] = []
    for r in results:
        if r.prompt_ids is None:
            raise ShapeMismatchError(
                f"sample {r.index}: prompt token ids unknown (text prompt and the server sent no "
                "meta_info.prompt_token_ids); send token-id prompts to build tensors"
            )
        seqs.append((list(r.prompt_ids), list(r.output_ids)))
    return seqs


def _response_values(r: Sample, n_out: int) -> np.ndarray | int:
    """``response_mask`` over a sample's output tokens: 1 everywhere, or a trajectory's loss mask
    (0 on tool/environment tokens the model did not generate)."""
    mask = getattr(r, "output_loss_mask", None)
    if mask is None:
        return 1
    arr = np.asarray(mask, dtype=np.int64)
    if arr.shape != (n_out,):
        raise ShapeMismatchError(f"sample {r.index}: loss mask has {arr.shape} entries for {n_out} output tokens")
    return arr


def _logprobs_of(results: Sequence[Sample], seqs: list[tuple[list[int], list[int]]]) -> tuple[bool, str | None]:
    """Whether the samples carry sampled log-probs (all or none, one per output token) and their one mode."""
    have = [getattr(r, "logprobs", None) is not None for r in results]
    if not any(have):
        return False, None
    if not all(have):
        missing = [r.index for r, h in zip(results, have) if not h][:8]
        raise ConfigurationError(
            f"samples {missing} carry no log-probs while others do: generate all of them "
            "with return_logprob=True (or none)"
        )
    for r, (_, o) in zip(results, seqs):
        if np.shape(r.logprobs) != (len(o),):
            raise ShapeMismatchError(f"sample {r.index}: {np.shape(r.logprobs)} log-probs for {len(o)} output tokens")
    modes = {getattr(r, "logprobs_mode", None) for r in results}
    if len(modes) > 1:
        raise ConfigurationError(f"samples carry log-probs of different modes {sorted(map(str, modes))}")
    return True, modes.pop()


def _indexer_of(results: Sequence[Sample], info: RRInfo) -> bool:
    """Whether the samples carry indexer picks (all or none, read: by reference, resolved first)."""
    have = [getattr(r, "indexer_topk", None) is not None for r in results]
    unread = [r.index for r in results if getattr(r, "indexer_ref", None) is not None and r.indexer_topk is None]  # type: ignore[attr-defined]
    if unread:
        raise MissingRoutingError(
            f"samples {unread[:8]} hold indexer refs not read yet: resolve them first "
            "(RoutedExpertsClient.resolve_results)"
        )
    if not any(have):
        return False
    if not all(have):
        missing = [r.index for r, h in zip(results, have) if not h][:8]
        raise MissingRoutingError(
            f"samples {missing} carry no indexer picks while others do: generate all of them with "
            "return_indexer_topk=True (or none)"
        )
    if info.indexer is None:
        raise ShapeMismatchError("the samples carry indexer picks, but the server's model has no indexer (/rr/info)")
    return True


def _indexer_columns(
    r: Sample, pos: np.ndarray, n_tokens: int, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """A sample's indexer rows moved into the batch: (the columns of the tokens they belong to, the columns they
    read), one vectorised gather. Rows of another shape than ``shape`` (indexer layers, index_topk), a negative
    position (SGLang's ``-1`` padding is not rr's form) or rows that overrun the sample are typed errors."""
    arr = np.asarray(r.indexer_topk)  # type: ignore[attr-defined]
    start = int(r.indexer_topk_start or 0)  # type: ignore[attr-defined]
    if arr.ndim != 3 or arr.shape[1:] != shape:
        raise ShapeMismatchError(
            f"sample {r.index}: indexer rows {list(arr.shape)}, expected [rows, {shape[0]} indexer layers, "
            f"index_topk {shape[1]}] (/rr/info)"
        )
    if arr.size and int(arr.min()) < 0:
        raise IndexerPositionError(
            f"sample {r.index}: an indexer row holds a negative position: rr's rows hold positions only "
            "(decode SGLang's -1-padded int32 with rr_client.decode_indexer)"
        )
    if start + arr.shape[0] > n_tokens - 1 or (arr.size and int(arr.max()) >= n_tokens):
        raise ShapeMismatchError(
            f"sample {r.index}: {arr.shape[0]} indexer rows from token {start} (positions up to "
            f"{int(arr.max()) if arr.size else '-'}) do not fit its {n_tokens} tokens"
        )
    return pos[start : start + arr.shape[0]], pos[arr]


def _layer_axis(info: RRInfo, moe_layers_only: bool) -> tuple[list[int], np.ndarray | None, LayerAxis]:
    """The batch's layer axis (the rows' one rule, :func:`rr_client.trainer.rows.axis_layers`): the MoE layers
    (``moe_layers_only``) or every decoder layer; the engine rows' positions to keep; its label."""
    n_axis = len(info.moe_layers) if moe_layers_only else info.num_hidden_layers
    layers = axis_layers(n_axis, num_hidden_layers=info.num_hidden_layers, moe_layers=info.moe_layers)
    if moe_layers_only:
        return layers, np.asarray(layers, dtype=np.int64), "moe"
    return layers, None, "absolute"


def _sample_rows(r: Sample, n_tokens: int, layer_index: np.ndarray | None) -> np.ndarray:
    """The sample's routing rows (layer axis selected), checked to fit its tokens minus the last."""
    arr = _routing_of(r)
    if layer_index is not None:
        arr = arr[:, layer_index]
    if r.routed_experts_start + arr.shape[0] > n_tokens:
        raise ShapeMismatchError(f"sample {r.index}: {arr.shape[0]} routing rows do not fit {n_tokens} tokens")
    return arr


def to_tensors(
    results: Sequence[Sample],
    info: RRInfo,
    *,
    pad_side: Literal["left", "right", "split"] = "left",
    layout: Literal["token_major", "layer_major"] = "token_major",
    moe_layers_only: bool = False,
    pad_token_id: int = 0,
    pad_to: int | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_experts: PadExperts = "zero",
) -> RoutingTensors:
    """Pad samples and their routing into one ``[B, T]`` batch.

    ``pad_side``: ``"left"`` (real tokens flush right), ``"right"`` (flush left) or ``"split"`` (verl:
    prompts left-padded to ``prompt_length``, responses right-padded to ``response_length``; ``T = P + R``;
    a longer prompt or response is a :class:`ShapeMismatchError`, never truncated). ``pad_experts``: what
    rows without routing hold (``"zero"``: 0, the mask tells them apart; ``"distinct"``: K distinct ids strided
    over all experts by pad ordinal and rotated per layer, :func:`rr_client.trainer.rows.pad_ids`, so pad tokens
    per expert stay within one of even; ``"minus_one"``: -1, in a signed dtype). ``position_ids`` (split only) count from 0 at the first real
    token; padding is 0. Samples with indexer picks (all or none) fill ``indexer_topk`` (token-major in either
    ``layout``), their positions moved to the batch's columns.
    """
    if pad_side not in ("left", "right", "split"):
        raise ConfigurationError(f"pad_side must be 'left', 'right' or 'split', got {pad_side!r}")
    if layout not in ("token_major", "layer_major"):
        raise ConfigurationError(f"layout must be 'token_major' or 'layer_major', got {layout!r}")
    split = pad_side == "split"
    if split:
        if prompt_length is None or response_length is None:
            raise ConfigurationError("pad_side='split' needs prompt_length and response_length")
        if pad_to is not None:
            raise ConfigurationError(
                "pad_to does not apply to pad_side='split' (the width is prompt_length + response_length)"
            )
    elif prompt_length is not None or response_length is not None:
        raise ConfigurationError("prompt_length / response_length apply only to pad_side='split'")
    seqs = _sequences(results)
    lengths = [len(p) + len(o) for p, o in seqs]
    if split:
        assert prompt_length is not None and response_length is not None
        for r, (p, o) in zip(results, seqs):
            if len(p) > prompt_length:
                raise ShapeMismatchError(
                    f"sample {r.index}: prompt has {len(p)} tokens > prompt_length={prompt_length}"
                )
            if len(o) > response_length:
                raise ShapeMismatchError(
                    f"sample {r.index}: response has {len(o)} tokens > response_length={response_length}"
                )
        width = prompt_length + response_length
    else:
        width = max(lengths, default=0)
        if pad_to is not None:
            if pad_to < width:
                raise ShapeMismatchError(f"pad_to={pad_to} is shorter than the longest sample ({width} tokens)")
            width = pad_to
    b = len(results)
    layers, layer_index, axis = _layer_axis(info, moe_layers_only)
    n_layers, k = len(layers), info.topk
    dt = _routing_dtype(info.num_experts, pad_experts)
    pad_row = _pad_row(pad_experts, n_layers, k)

    ids = np.full((b, width), pad_token_id, dtype=np.int64)
    attn = np.zeros((b, width), dtype=np.int64)
    resp = np.zeros((b, width), dtype=np.int64)
    rmask = np.zeros((b, width), dtype=np.bool_)
    pos_ids = np.zeros((b, width), dtype=np.int64) if split else None
    routing = np.zeros((b, width, n_layers, k), dtype=dt)  # calloc: pad rows cost no writes
    if pad_row is not None:
        routing[...] = pad_row
    has_lp, lp_mode = _logprobs_of(results, seqs)
    lps = np.full((b, width), np.nan, dtype=np.float32) if has_lp else None
    idx = None
    if _indexer_of(results, info):
        assert info.indexer is not None
        dims = info.indexer
        idx = np.full((b, width, len(dims.layers), dims.index_topk), -1, np.int16 if width <= 32767 else np.int32)

    for i, (r, (p, o), n) in enumerate(zip(results, seqs, lengths)):
        # pos[j]: column of token j of the sample
        if split:
            assert prompt_length is not None
            pos = np.concatenate(
                [np.arange(prompt_length - len(p), prompt_length), np.arange(prompt_length, prompt_length + len(o))]
            )
        else:
            off = width - n if pad_side == "left" else 0
            pos = np.arange(off, off + n)
        ids[i, pos] = p + o
        attn[i, pos] = 1
        resp[i, pos[len(p) :]] = _response_values(r, len(o))
        if lps is not None:
            lps[i, pos[len(p) :]] = r.logprobs
        if pos_ids is not None:
            pos_ids[i, pos] = np.arange(n)
        arr = _sample_rows(r, n, layer_index)
        cols = pos[r.routed_experts_start : r.routed_experts_start + arr.shape[0]]
        rmask[i, cols] = True
        routing[i, cols] = arr
        if idx is not None:
            at, read = _indexer_columns(r, pos, n, idx.shape[2:])
            idx[i, at] = read
    if pad_experts == "distinct":
        _spread_pads(routing, rmask, layers, info.num_experts)

    out = torch.from_numpy(routing)
    if layout == "layer_major":
        out = out.permute(2, 0, 1, 3).contiguous()
    return RoutingTensors(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        response_mask=torch.from_numpy(resp),
        routed_experts=out,
        routed_experts_mask=torch.from_numpy(rmask),
        layers=layers,
        layer_axis=axis,
        position_ids=None if pos_ids is None else torch.from_numpy(pos_ids),
        logprobs=None if lps is None else torch.from_numpy(lps),
        logprobs_mode=lp_mode,
        provenance=_provenances(results),
        indexer_topk=None if idx is None else torch.from_numpy(idx),
        indexer_layers=None if idx is None or info.indexer is None else list(info.indexer.layers),
    )


def to_packed(
    results: Sequence[Sample],
    info: RRInfo,
    *,
    moe_layers_only: bool = False,
    append_row: bool = True,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    pad_experts: PadExperts = "zero",
) -> PackedRouting:
    """Pack samples and their routing into THD tensors (slime, Megatron, verl's remove-padding path).

    Samples are concatenated in order. ``pad_to_multiple_of=M`` appends pad tokens (``pad_token_id``,
    position 0.., masks False, routing = the pad value) so that N is a multiple of M (TP/CP splits); with
    ``append_row=False`` the routing rows get the same number of pad rows.
    """
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ConfigurationError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    seqs = _sequences(results)
    if _indexer_of(results, info):
        raise ConfigurationError(
            "the samples carry indexer picks, which rr replays in a padded batch (to_tensors): transformers' DSA "
            "indexers score a whole packed row across its samples. Pad them, or pack the routing alone "
            "(dataclasses.replace(r, indexer_topk=None))"
        )
    lengths = [len(p) + len(o) for p, o in seqs]
    if not append_row and any(n == 0 for n in lengths):
        raise ShapeMismatchError("append_row=False needs every sample to have at least one token")
    n_real = sum(lengths)
    n_pad = 0
    if pad_to_multiple_of is not None:
        n_pad = -n_real % pad_to_multiple_of
    n_total = n_real + n_pad
    b = len(results)
    layers, layer_index, axis = _layer_axis(info, moe_layers_only)
    n_layers, k = len(layers), info.topk
    dt = _routing_dtype(info.num_experts, pad_experts)
    pad_row = _pad_row(pad_experts, n_layers, k)

    cu = np.zeros(b + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lengths)
    row_lengths = lengths if append_row else [n - 1 for n in lengths]
    rcu = np.zeros(b + 1, dtype=np.int32)
    rcu[1:] = np.cumsum(row_lengths)
    n_rows = int(rcu[-1]) + n_pad

    ids = np.full(n_total, pad_token_id, dtype=np.int64)
    pos_ids = np.zeros(n_total, dtype=np.int64)
    resp = np.zeros(n_total, dtype=np.int64)
    rmask = np.zeros(n_rows, dtype=np.bool_)
    routing = np.zeros((n_rows, n_layers, k), dtype=dt)
    if pad_row is not None:
        routing[...] = pad_row
    has_lp, lp_mode = _logprobs_of(results, seqs)
    lps = np.full(n_total, np.nan, dtype=np.float32) if has_lp else None
    for i, (r, (p, o), n) in enumerate(zip(results, seqs, lengths)):
        s = int(cu[i])
        ids[s : s + n] = p + o
        pos_ids[s : s + n] = np.arange(n)
        resp[s + len(p) : s + n] = _response_values(r, len(o))
        if lps is not None:
            lps[s + len(p) : s + n] = r.logprobs
        arr = _sample_rows(r, n, layer_index)
        r0 = int(rcu[i]) + r.routed_experts_start
        rmask[r0 : r0 + arr.shape[0]] = True
        routing[r0 : r0 + arr.shape[0]] = arr
    if pad_experts == "distinct":
        _spread_pads(routing, rmask, layers, info.num_experts)
    pos_ids[n_real:] = np.arange(n_pad)
    return PackedRouting(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos_ids),
        cu_seqlens=torch.from_numpy(cu),
        response_mask=torch.from_numpy(resp),
        routed_experts=torch.from_numpy(routing),
        routed_experts_mask=torch.from_numpy(rmask),
        routing_cu_seqlens=torch.from_numpy(rcu),
        layers=layers,
        layer_axis=axis,
        num_pad_tokens=n_pad,
        logprobs=None if lps is None else torch.from_numpy(lps),
        logprobs_mode=lp_mode,
        provenance=_provenances(results),
    )
