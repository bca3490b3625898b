"""Batched sampling with a KV cache for Hugging Face causal LMs, with exact logprobs.

One call decodes one batch of requests to completion; each row keeps its own temperature,
top-p, top-k, stop strings, length budget and (optional) seed. Rows are left-padded for
the prefill, and rows with the same prompt (a group's ``n`` samples) share one prefill; rows
that finish are dropped from the batch (and its cache) once enough of them have, so long
generations do not pay for short ones.

    prefill(left-padded prompts) ─► logits ─► sample ─► finished? ─► compact ─┐
                                      ▲                                       │
                                      └──── forward(one token per row) ◄──────┘

The logprob of a token is ``log_softmax(logits / T)`` at that token: top-p / top-k (and EOS
before a row's ``min_new_tokens``) only restrict which tokens may be drawn. With a seed, a row
draws from its own generator, so its tokens do not depend on which other requests share the
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from astraflow.models.padding import left_padded
from astraflow.raas.engines.base import GREEDY_BELOW, GenerationRequest
from astraflow.workflows.api import FinishReason

__all__ = ["BatchDecoder", "DecodedRow", "sample_next"]

#: Compact the batch when at least this fraction of its rows has finished.
_COMPACT_FRACTION = 0.25
#: Ask for requests that may join the running batch every this many decode steps (each join
#: costs a prefill and a copy of the cache).
_JOIN_EVERY = 2


def _appendable(cache: Any) -> bool:
    """Rows can join ``cache`` (every layer a plain growing key/value cache; a sliding-window
    or linear-attention layer is not padded safely, so such models never join)."""
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = list(getattr(cache, "layers", None) or ())
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` left-padded with zeros along its sequence axis (dim 1 of a mask, -2 of keys)."""
    dim = 1 if x.dim() == 2 else -2
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _notify(on_done: Callable[[DecodedRow], None] | None, row: DecodedRow) -> None:
    if on_done is not None:
        on_done(row)


@dataclass
class DecodedRow:
    """The running state, then the result, of one request in a batch."""

    request: GenerationRequest
    budget: int
    """New tokens allowed (request and context permitting)."""
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def floor(self) -> int:
        """Tokens generated before EOS or a stop string may end the row."""
        return min(self.request.min_new_tokens, self.budget)


@dataclass(eq=False)
class _Lane:
    """Rows decoding together on one model: their cache, mask, next positions, sampling
    parameters, the logits to draw their next tokens from, and the next input."""

    model: Any
    live: list[DecodedRow]
    cache: Any
    mask: torch.Tensor
    next_pos: torch.Tensor
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    logits: torch.Tensor
    step: torch.Tensor | None = None
    fresh: bool = False
    """Created this step from a prefill: its logits are ready, no forward pass yet."""
    ended: bool = False


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return the tokens and their tempered logprobs.

    Args:
        logits: ``[B, V]`` float32 next-token logits.
        temperature: ``[B]``; below ``GREEDY_BELOW`` (0 included) marks a greedy row.
        top_k: ``[B]`` long, 0 for off. top_p: ``[B]``, 1.0 for off.
        generators: per-row generator (seeded requests) or ``None`` (use ``shared``).
        banned: optional ``[B, V]`` bool, True where a token may not be drawn (EOS before
            ``min_new_tokens``); it changes what is drawn, not the reported logprobs.
    """
    greedy = temperature < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    allowed = logprobs if banned is None else logprobs.masked_fill(banned, float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        allowed = _restrict(allowed, top_k, top_p)
    probs = allowed.exp()
    tokens = torch.multinomial(probs, 1, generator=shared).squeeze(1)
    for row, gen in enumerate(generators):
        if gen is not None:
            tokens[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    if bool(greedy.any()):
        tokens = torch.where(greedy, allowed.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(1)


def _restrict(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logprobs`` with every token outside each row's top-k / top-p set to -inf."""
    vocab = logprobs.shape[-1]
    ordered, order = logprobs.sort(dim=-1, descending=True)
    probs = ordered.exp()
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before > top_p[:, None]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop |= torch.arange(vocab, device=logprobs.device)[None, :] >= k[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logprobs).scatter_(-1, order, ordered)


class BatchDecoder:
    """Runs batches of requests through one causal LM (called from one thread only)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.pad_id = pad_id
        self.device = device
        # sampling runs where the logits are: only B tokens and logprobs cross per step
        self.shared = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def run(
        self,
        rows: Sequence[DecodedRow],
        abort: Callable[[], bool] | None = None,
        *,
        join: Callable[[int], list[DecodedRow]] | None = None,
        on_done: Callable[[DecodedRow], None] | None = None,
        on_step: Callable[[], None] | None = None,
        on_lane: Callable[[Any, bool], None] | None = None,
    ) -> None:
        """Decode every row to completion (fills ``token_ids``, ``logprobs``, ``finish_reason``).

        ``abort`` is asked before every step: once it says yes (the engine is closing), the
        unfinished rows end there with finish reason ``abort`` instead of running on for up to
        ``max_new_tokens`` more steps.

        Continuous batching: ``join`` is asked every few steps, with the number of rows still
        decoding, for requests that arrived since the batch started; they are prefilled on
        their own and join the running batch (both caches left-padded to one length, so every
        row keeps its own positions and mask). ``on_done`` is called with each row as soon as
        it finishes, so its caller need not wait for the longest row of the batch; ``on_step``
        after each step's rows were handed to ``on_done`` (the engine wakes their callers then).

        Lanes: rows starting now decode with ``self.model``. When the caller replaces it
        mid-batch (new weights swapped in, e.g. from ``join``), rows that join after that
        start a new lane on the new model while the rows already decoding finish in their own
        lane on the model they started with: each step runs one forward pass per lane, and no
        row ever mixes two models. ``on_lane(model, True)`` is called when a lane
        starts and ``on_lane(model, False)`` when its last row ends.
        """
        lanes = [self._lane(self.model, list(rows), on_lane)]
        joinable = join is not None and _appendable(lanes[0].cache)
        steps = 0
        try:
            while lanes:
                if abort is not None and abort():
                    self._abort(lanes, on_done)
                    return
                for lane in lanes:
                    lane.step = self._advance(lane, on_done)
                if on_step is not None:
                    on_step()
                for lane in [lane for lane in lanes if lane.step is None]:
                    lanes.remove(lane)
                    self._end(lane, on_lane)
                steps += 1
                if joinable and steps % _JOIN_EVERY == 0:
                    assert join is not None
                    new = join(sum(r.finish_reason is None for lane in lanes for r in lane.live))
                    if new:
                        self._place(new, lanes, self.model, on_done, on_lane)
                        if on_step is not None:
                            on_step()
                for lane in lanes:
                    self._step(lane)
        finally:
            for lane in lanes:
                self._end(lane, on_lane)

    def _place(
        self,
        new: list[DecodedRow],
        lanes: list[_Lane],
        model: Any,
        on_done: Callable[[DecodedRow], None] | None,
        on_lane: Callable[[Any, bool], None] | None,
    ) -> None:
        """Rows that join: into the newest lane when it decodes on ``model``, else (new
        weights since it started) into a lane of their own."""
        if lanes and lanes[-1].model is model:
            self._join(new, lanes[-1], on_done)
        else:
            lanes.append(self._lane(model, new, on_lane, fresh=True))

    def _step(self, lane: _Lane) -> None:
        """One forward pass of the lane's rows (a lane made this step has its logits)."""
        if lane.fresh:
            lane.fresh = False
            return
        assert lane.step is not None
        lane.mask = torch.cat([lane.mask, lane.mask.new_ones((lane.mask.shape[0], 1))], dim=1)
        lane.logits = self._forward(
            lane.model, lane.step, lane.mask, lane.next_pos, lane.cache
        ).logits
        lane.next_pos = lane.next_pos + 1

    @staticmethod
    def _abort(lanes: list[_Lane], on_done: Callable[[DecodedRow], None] | None) -> None:
        for lane in lanes:
            for row in lane.live:
                if row.finish_reason is None:
                    row.finish_reason = "abort"
                    _notify(on_done, row)

    def _lane(
        self,
        model: Any,
        rows: list[DecodedRow],
        on_lane: Callable[[Any, bool], None] | None,
        *,
        fresh: bool = False,
    ) -> _Lane:
        """Prefill ``rows`` on ``model``: a new lane whose logits are ready to draw from."""
        cache, mask, positions, logits = self._prefill(model, rows)
        lane = _Lane(model, rows, cache, mask, positions[:, -1:] + 1, self._params(rows), logits,
                     fresh=fresh)  # fmt: skip
        if on_lane is not None:
            on_lane(model, True)
        return lane

    @staticmethod
    def _end(lane: _Lane, on_lane: Callable[[Any, bool], None] | None) -> None:
        if not lane.ended:
            lane.ended = True
            if on_lane is not None:
                on_lane(lane.model, False)

    def _advance(
        self, lane: _Lane, on_done: Callable[[DecodedRow], None] | None
    ) -> torch.Tensor | None:
        """Draw each of the lane's rows a token; drop finished rows from it once enough have.
        The next input (one token per row left), or None once every row has finished."""
        tokens, done = self._draw(lane.live, lane.logits, lane.params, on_done)
        if len(done) == len(lane.live):
            lane.live = []
            return None
        step = tokens[:, None]
        if len(done) >= max(1, int(_COMPACT_FRACTION * len(lane.live))):
            keep = [i for i in range(len(lane.live)) if i not in done]
            index = torch.tensor(keep, device=self.device)
            lane.cache.batch_select_indices(index)
            lane.mask, lane.next_pos, step = lane.mask[index], lane.next_pos[index], step[index]
            lane.live = [lane.live[i] for i in keep]
            lane.params = self._params(lane.live)
        return step

    def _prefill(
        self, model: Any, rows: Sequence[DecodedRow]
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Seed the rows and run their left-padded prompts through ``model``: a new cache,
        the attention mask, the positions and the logits of the last position.

        Rows with the same prompt (the ``n`` samples of a group) share one prefill: each
        distinct prompt runs once and its cache rows are copied to every row that asked for it
        (where every layer is a plain key/value cache)."""
        from transformers import DynamicCache

        for row in rows:
            if row.request.seed is not None:
                row.generator = torch.Generator(device=self.device).manual_seed(row.request.seed)
        cache = DynamicCache(config=model.config)
        distinct: dict[tuple[int, ...], int] = {}
        where = [distinct.setdefault(tuple(r.request.prompt_ids), len(distinct)) for r in rows]
        shared = len(distinct) < len(rows) and _appendable(cache)
        prompts = list(distinct) if shared else [r.request.prompt_ids for r in rows]
        ids, mask = self._left_pad(prompts)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits: torch.Tensor = self._forward(
            model, ids, mask, positions, cache, logits_to_keep=1
        ).logits
        if shared:
            index = torch.tensor(where, device=self.device)
            cache.batch_select_indices(index)
            mask, positions, logits = mask[index], positions[index], logits[index]
        return cache, mask, positions, logits

    def _draw(
        self,
        rows: Sequence[DecodedRow],
        logits: torch.Tensor,
        params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        on_done: Callable[[DecodedRow], None] | None,
    ) -> tuple[torch.Tensor, set[int]]:
        """Draw each row's next token from ``logits`` and record it: the tokens, and the
        indices of the rows that are finished."""
        tokens, logprobs = sample_next(
            logits[:, -1, :].float(),
            *params,
            [r.generator for r in rows],
            self.shared,
            self._banned(rows, logits.shape[-1]),
        )
        return tokens, self._record(rows, tokens.tolist(), logprobs.tolist(), on_done)

    def _join(
        self, new: list[DecodedRow], lane: _Lane, on_done: Callable[[DecodedRow], None] | None
    ) -> None:
        """Prefill ``new`` on its own cache, draw each row's first token, and append the rows
        that go on to ``lane``: its cache, mask, positions and next input."""
        sub, new_mask, positions, logits = self._prefill(lane.model, new)
        tokens, done = self._draw(new, logits, self._params(new), on_done)
        keep = [i for i in range(len(new)) if i not in done]
        if not keep:
            return
        assert lane.step is not None
        index = torch.tensor(keep, device=self.device)
        if len(keep) < len(new):
            sub.batch_select_indices(index)
        new_mask, positions, tokens = new_mask[index], positions[index], tokens[index]
        length = max(lane.mask.shape[1], new_mask.shape[1])
        for layer, extra in zip(lane.cache.layers, sub.layers, strict=True):
            layer.keys = torch.cat([_pad_left(layer.keys, length), _pad_left(extra.keys, length)])
            layer.values = torch.cat(
                [_pad_left(layer.values, length), _pad_left(extra.values, length)]
            )
        lane.mask = torch.cat([_pad_left(lane.mask, length), _pad_left(new_mask, length)])
        lane.next_pos = torch.cat([lane.next_pos, positions[:, -1:] + 1])
        lane.step = torch.cat([lane.step, tokens[:, None]])
        lane.live += [new[i] for i in keep]
        lane.params = self._params(lane.live)

    @staticmethod
    def _forward(
        model: Any,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        **kw: Any,
    ) -> Any:
        """One forward pass of ``model`` over ``ids`` that extends the KV ``cache``."""
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **kw,
        )

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = left_padded(prompts, self.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def _params(
        self, rows: Sequence[DecodedRow]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reqs = [r.request for r in rows]
        dev = self.device
        return (
            torch.tensor([q.temperature for q in reqs], dtype=torch.float32, device=dev),
            torch.tensor([q.top_k for q in reqs], dtype=torch.long, device=dev),
            torch.tensor([q.top_p for q in reqs], dtype=torch.float32, device=dev),
        )

    def _banned(self, live: Sequence[DecodedRow], vocab: int) -> torch.Tensor | None:
        """EOS tokens for the rows still short of their ``min_new_tokens`` (None: no such row)."""
        short = [i for i, r in enumerate(live) if len(r.token_ids) < r.floor]
        if not short or not self.eos_ids:
            return None
        banned = torch.zeros((len(live), vocab), dtype=torch.bool, device=self.device)
        eos = torch.tensor(sorted(t for t in self.eos_ids if t < vocab), device=self.device)
        rows = torch.tensor(short, device=self.device)
        banned[rows[:, None], eos[None, :]] = True
        return banned

    def _record(
        self,
        live: Sequence[DecodedRow],
        tokens: list[int],
        lps: list[float],
        on_done: Callable[[DecodedRow], None] | None = None,
    ) -> set[int]:
        """Append each live row's token; return the indices of rows that are now finished
        (``on_done`` is called with each row that finished at this token)."""
        done: set[int] = set()
        for i, row in enumerate(live):
            if row.finish_reason is not None:
                done.add(i)
                continue
            row.token_ids.append(tokens[i])
            row.logprobs.append(lps[i])
            may_stop = len(row.token_ids) >= row.floor  # before it, EOS is never drawn
            if may_stop and (tokens[i] in self.eos_ids or self._hit_stop(row)):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.budget:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                done.add(i)
                _notify(on_done, row)
        return done

    def _hit_stop(self, row: DecodedRow) -> bool:
        stops = row.request.stop
        if not stops:
            return False
        window = max(len(s) for s in stops) + 4
        # only tokens from the min_new_tokens-th on may make a stop string
        start = max(len(row.token_ids) - window, row.floor - 1, 0)
        tail = self.tokenizer.decode(row.token_ids[start:], skip_special_tokens=False)
        return any(s in tail for s in stops)
