"""Multi-turn rollouts: one token sequence, one routing array, one loss mask, built turn by turn.

Every turn sends the whole conversation and asks only for the rows not held yet (``routed_experts_start`` =
rows held), so routing bytes grow with the new tokens, not with the conversation. Every turn is checked:
the engine's prompt must begin with the tokens held (else :class:`TokenMismatchError` at the first
differing position, never a shifted array) and it must send exactly ``tokens - 1 - start`` rows. Each turn keeps
its provenance and where its segments lie in the trajectory's rows (:class:`TurnSpan`), for the audit by turn.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rr_client.client._results import GenerateBatch, GenerateResult
from rr_client.core.errors import (
    ArgumentTypeError,
    ConfigurationError,
    MissingRoutingError,
    ShapeMismatchError,
    TokenMismatchError,
)
from rr_client.core.provenance import Provenance
from rr_client.core.reference import RoutingRef


class TurnClient(Protocol):
    """What a trajectory needs of its client (:class:`RoutedExpertsClient` is one): a turn over ``/generate`` or
    the chat endpoint, and reading refs. Named here, so the trajectory never imports the client that makes it."""

    async def generate(
        self,
        prompts: Any,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        routed_experts_start: int = 0,
        affinity: Hashable | None = None,
        by_reference: bool = False,
    ) -> GenerateBatch: ...

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        routed_experts_start: int = 0,
        affinity: Hashable | None = None,
    ) -> GenerateBatch: ...

    async def resolve(self, refs: Sequence[RoutingRef], *, tokens: Any = None) -> list[np.ndarray]: ...


__all__ = ["Trajectory", "ChatTrajectory", "TurnSpan"]

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class TurnSpan:
    """Where one turn's rows lie in the trajectory's rows (row ``t``: the routing of token ``t``), as ``[start,
    stop)`` ranges, and its provenance: ``rows`` what this turn sent (from the rows held before it); of those,
    ``cached_prompt`` (prompt tokens the engine served from its prefix cache), ``computed_prompt`` (the rest of its
    prompt: the tool / template tokens added since the last turn and the previous turn's last token), and
    ``generated`` (its output tokens but the last, whose row comes with the next turn). ``cached_prompt`` is empty
    when the provenance is None (not known)."""

    turn: int
    provenance: Provenance | None
    rows: tuple[int, int]
    cached_prompt: tuple[int, int]
    computed_prompt: tuple[int, int]
    generated: tuple[int, int]

    @classmethod
    def of(cls, turn: int, provenance: Provenance | None, start: int, prompt_len: int, output_len: int) -> TurnSpan:
        """The spans of a turn whose rows begin at ``start`` over a prompt of ``prompt_len`` tokens."""
        stop = max(start, prompt_len + output_len - 1)
        cached = provenance.cached_tokens if provenance is not None else 0
        p = min(max(prompt_len, start), stop)
        c = min(max(cached, start), p)
        return cls(turn, provenance, (start, stop), (start, c), (c, p), (p, stop))


def _token_list(token_ids: Sequence[int], what: str) -> list[int]:
    """Validated non-negative int token ids."""
    if isinstance(token_ids, (str, bytes)) or not all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in token_ids
    ):
        raise ArgumentTypeError(f"{what} must be a list of non-negative int token ids")
    return [int(t) for t in token_ids]


def _first_difference(held: Sequence[int], prompt: Sequence[int]) -> int | None:
    """First index where ``prompt`` does not continue ``held`` (None when ``held`` is a prefix of it)."""
    n = min(len(held), len(prompt))
    a, b = np.asarray(held[:n], dtype=np.int64), np.asarray(prompt[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    if diff.size:
        return int(diff[0])
    return None if len(prompt) >= len(held) else n


def _one_continuation(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A turn's sampling params, refused unless they sample one continuation (``n=1``): a trajectory has one."""
    params = dict(sampling_params or {})
    if params.get("n", 1) != 1:
        raise ConfigurationError("a trajectory turn samples one continuation (n=1)")
    return params


class _Rollout:
    """Tokens, loss mask and routing rows of one conversation; what both trajectory kinds share."""

    def __init__(
        self, client: TurnClient, prompt_ids: Sequence[int], affinity: Hashable | None, by_reference: bool = False
    ) -> None:
        self._client = client
        self._tokens = _token_list(prompt_ids, "prompt_ids")
        self._prompt_len = len(self._tokens)
        self._mask = [False] * len(self._tokens)
        self.by_reference = by_reference
        self._chunks: list[np.ndarray | RoutingRef] = []  # each turn's new rows, or their ref until resolved
        self._rows = 0
        self._cache: np.ndarray | None = None
        self.affinity: Hashable = affinity if affinity is not None else f"rr-trajectory-{next(_ids)}"
        self.turns: list[GenerateResult] = []
        self._spans: list[TurnSpan] = []
        self._ref_tokens: dict[str, tuple[list[int], list[int]]] = {}  # ref key -> its turn's (prompt, output)
        self.index = 0  # sample index in error messages of to_tensors

    # -- what trainers read
    @property
    def input_ids(self) -> list[int]:
        """Every token of the conversation so far."""
        return list(self._tokens)

    @property
    def loss_mask(self) -> list[bool]:
        """True only on tokens the model generated (prompt, tool and template tokens are False)."""
        return list(self._mask)

    @property
    def num_rows(self) -> int:
        """Routing rows held: ``len(input_ids) - 1`` right after a turn."""
        return self._rows

    @property
    def routed_experts(self) -> np.ndarray:
        """``(rows, layers, topk)``: row ``t`` is the routing of token ``t`` (one array for the whole conversation)."""
        if self._cache is None or self._cache.shape[0] != self._rows:
            if not self._chunks:
                raise ShapeMismatchError("the trajectory holds no routing yet: run a turn first")
            if self.routing_refs:
                raise MissingRoutingError(
                    f"trajectory {self.index}: {len(self.routing_refs)} turns' routing is held "
                    "by reference: await traj.resolve() (or resolve routing_refs) first"
                )
            arrays = [c for c in self._chunks if isinstance(c, np.ndarray)]
            self._cache = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
            self._chunks = [self._cache]
        return self._cache

    @property
    def routing_refs(self) -> list[RoutingRef]:
        """The turns' routing refs not resolved yet, in turn order: each covers only that turn's new rows, so
        whoever resolves them (a trainer rank) reads every row of the conversation exactly once."""
        return [c for c in self._chunks if isinstance(c, RoutingRef)]

    @property
    def turn_spans(self) -> list[TurnSpan]:
        """Each turn's provenance and the row ranges of its cached prompt, computed prompt and generated tokens."""
        return list(self._spans)

    @property
    def provenances(self) -> list[Provenance | None]:
        """Each turn's provenance, in turn order (None where the server gave none)."""
        return [t.provenance for t in self._spans]

    async def resolve(self) -> np.ndarray:
        """Read the rows of every turn held by reference (one call per server, each ref bound to its turn's
        tokens) and return :attr:`routed_experts`."""
        refs = self.routing_refs
        if refs:
            rows = iter(await self._client.resolve(refs, tokens=[self._ref_tokens.get(r.key) for r in refs]))
            self._chunks = [next(rows) if isinstance(c, RoutingRef) else c for c in self._chunks]
        return self.routed_experts

    # -- the Sample protocol of rr_client.to_tensors / to_packed
    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt (the rest of the conversation is the "response", masked by ``loss_mask``)."""
        return self._tokens[: self._prompt_len]

    @property
    def output_ids(self) -> list[int]:
        """Every token after the first prompt: generated, tool and template tokens."""
        return self._tokens[self._prompt_len :]

    @property
    def output_loss_mask(self) -> list[bool]:
        """``loss_mask`` over :attr:`output_ids`."""
        if self._rows != len(self._tokens) - 1:
            raise ShapeMismatchError(
                f"trajectory {self.index}: {len(self._tokens)} tokens but {self._rows} routing rows; the tokens "
                "added after the last turn have no routing yet (end the conversation with a model turn)"
            )
        return self._mask[self._prompt_len :]

    @property
    def routed_experts_start(self) -> int:
        return 0

    # -- turns
    def _check_prompt(self, engine_prompt: Sequence[int], turn: int) -> None:
        """Raise TokenMismatchError unless the engine's prompt begins with every token held."""
        pos = _first_difference(self._tokens, engine_prompt)
        if pos is None:
            return
        got = int(engine_prompt[pos]) if pos < len(engine_prompt) else None
        lo = max(0, pos - 3)
        raise TokenMismatchError(
            f"turn {turn}: the engine's prompt ({len(engine_prompt)} tokens) does not begin with the trajectory's "
            f"{len(self._tokens)} tokens: first difference at position {pos} (held {self._tokens[lo : pos + 4]}, "
            f"engine {list(engine_prompt[lo : pos + 4])} from position {lo}); typically a chat template that "
            "re-tokenized an earlier turn. Every routing row after it would sit on the wrong token",
            position=pos,
            expected=self._tokens[pos],
            got=got,
        )

    def _take_turn(self, res: GenerateResult, start: int) -> None:
        """Append one checked turn: template/tool tokens between held and prompt end, then the output."""
        prompt = res.prompt_ids or []
        self._check_prompt(prompt, len(self.turns))
        held: np.ndarray | RoutingRef | None = res.routed_experts if res.routed_experts is not None else res.routing_ref
        if held is None or res.routed_experts_start != start:
            raise ShapeMismatchError(f"turn {len(self.turns)}: no routing from row {start}")
        n = held.rows if isinstance(held, RoutingRef) else held.shape[0]
        want = len(prompt) + len(res.output_ids) - 1 - start
        if n != want:  # parse already checked this; kept as the invariant this class relies on
            raise ShapeMismatchError(f"turn {len(self.turns)}: {n} rows, expected {want}")
        added = prompt[len(self._tokens) :]
        self._tokens.extend(added)
        self._mask.extend([False] * len(added))
        self._tokens.extend(res.output_ids)
        self._mask.extend([True] * len(res.output_ids))
        self._chunks.append(held)
        if isinstance(held, RoutingRef):
            self._ref_tokens[held.key] = (list(prompt), list(res.output_ids))
        self._spans.append(TurnSpan.of(len(self.turns), res.provenance, start, len(prompt), len(res.output_ids)))
        self._rows += n
        self.turns.append(res)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append environment or tool tokens; they are not trained on (``loss_mask`` False)."""
        ids = _token_list(token_ids, "token_ids")
        self._tokens.extend(ids)
        self._mask.extend([False] * len(ids))

    def __len__(self) -> int:
        return len(self._tokens)


class Trajectory(_Rollout):
    """A multi-turn rollout by token ids over ``/generate`` (``client.trajectory(prompt_ids)``).

    ``await traj.generate(params)`` runs one model turn; ``traj.extend(tool_ids)`` adds environment tokens.
    ``traj.input_ids``, ``traj.routed_experts`` (``len(input_ids) - 1`` rows after a turn) and
    ``traj.loss_mask`` are trainer-ready; ``rr_client.to_tensors([traj, ...], info)`` pads trajectories.
    ``by_reference``: each turn's new rows stay on the server; :attr:`routing_refs` holds one ref per turn and
    ``await traj.resolve()`` reads them.
    """

    def __init__(
        self,
        client: TurnClient,
        prompt_ids: Sequence[int],
        *,
        affinity: Hashable | None = None,
        by_reference: bool = False,
    ) -> None:
        super().__init__(client, prompt_ids, affinity, by_reference)
        if not self._tokens:
            raise ConfigurationError("prompt_ids is empty")

    async def generate(self, sampling_params: Mapping[str, Any] | None = None) -> GenerateResult:
        """One model turn on every token so far, asking only for the rows not held yet."""
        params = _one_continuation(sampling_params)
        start = self._rows
        batch = await self._client.generate(
            [list(self._tokens)],
            params,
            routed_experts_start=start,
            affinity=self.affinity,
            by_reference=self.by_reference,
        )
        res = batch[0]
        reported = res.meta.get("prompt_token_ids")
        if isinstance(reported, list):
            self._check_prompt(reported, len(self.turns))
        self._take_turn(res, start)
        return res


class ChatTrajectory(_Rollout):
    """A multi-turn rollout over ``/v1/chat/completions`` (``client.chat_trajectory(messages)``).

    The engine applies the chat template to every message each turn; the tokens it reports must begin with
    every token held so far (the previous turns' prompt and output), else :class:`TokenMismatchError`.
    Template tokens the engine adds between turns (role headers, end-of-turn markers, tool messages) join the
    trajectory with ``loss_mask`` False. ``traj.add(message)`` appends a tool/user message.
    """

    def __init__(
        self,
        client: TurnClient,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        affinity: Hashable | None = None,
    ) -> None:
        super().__init__(client, [], affinity)
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.tools = [dict(t) for t in tools] if tools is not None else None

    def add(self, message: Mapping[str, Any]) -> None:
        """Append a message (tool result, user turn); its tokens arrive with the next turn's prompt."""
        self.messages.append(dict(message))

    async def chat(self, sampling_params: Mapping[str, Any] | None = None) -> GenerateResult:
        """One model turn; the assistant message is appended to ``messages``."""
        params = _one_continuation(sampling_params)
        start = self._rows
        batch = await self._client.chat(
            self.messages, params, tools=self.tools, routed_experts_start=start, affinity=self.affinity
        )
        res = batch[0]
        if not self.turns:
            self._tokens = []  # the first prompt is whatever the template made of the messages
        self._take_turn(res, start)
        if not self._prompt_len:
            self._prompt_len = len(res.prompt_ids or [])
        message = res.meta.get("message")
        reply: dict[str, Any] = {"role": "assistant", "content": res.text or ""}
        if isinstance(message, Mapping) and message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self.messages.append(reply)
        return res
