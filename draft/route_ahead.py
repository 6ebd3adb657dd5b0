"""Route-ahead: predict the experts a verify pass will touch and prefetch them early.

A verify pass over a block of B tokens touches, in each target MoE layer, the union of the top-k
experts of its B positions. As soon as a block is drafted (or earlier, for predictors that do not
need the draft), a predictor names per layer the experts it expects, and :class:`RouteAhead` hands
them to a prefetch sink ``sink({layer: [experts]}, priority)`` — the offload runtime's
``ExpertPrefetcher.prefetch_experts`` — so the transfers overlap the draft and the early layers of
the verify pass. After the verify pass, the experts its routers really chose (recorded by
:class:`~pdflash.draft.taps.RouterTap`) are compared with the predictions.

Predictors (``make_predictor`` names; join names with ``+`` for the union of several):

- ``draft-router``: every target layer's router applied to the draft's final hidden states of the
  block (after that layer's ``post_attention_layernorm`` weights). An approximation: the router of
  layer L really sees the target's residual stream entering layer L's MLP, which differs per layer;
  the draft's final state stands in for all of them. Submitted right after the draft forward.
- ``previous``: the experts the previous verify pass (or, for the first step, the last B positions
  of the prefill) used. Known before the draft runs, so it is submitted before the draft forward.
- ``lookahead``: during the verify pass, the hidden state entering layer L is routed through the
  routers of layers L+1 .. L+depth. Layer 0 is never predicted by it.

Quality counters (micro-averaged over steps): per layer ``predicted`` = |P|, ``used`` = |U|,
``hits`` = |P ∩ U|; recall = hits / used, precision = hits / predicted; useful bytes = hits x
bytes_per_expert, wasted bytes = (predicted - hits) x bytes_per_expert. These are predictor-level
figures: an expert predicted while already resident costs no transfer in the runtime, whose own
statistics report the bytes it actually moved.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.draft.taps import RouterTap, decoder_layers

ExpertSets = dict[int, set[int]]  # target layer -> expert ids
PrefetchSink = Callable[[dict[int, list[int]], int], Any]

ROUTE_AHEAD_PRIORITY = 1  # the native scheduler's Band.ROUTE_AHEAD
PREDICTORS = ("draft-router", "previous", "lookahead")


def union_experts(indices: dict[int, torch.Tensor], last: int | None = None) -> ExpertSets:
    """Layer -> set of experts over the positions of ``indices[layer]`` [T, k] (only the last
    ``last`` positions when given)."""
    out: ExpertSets = {}
    for layer, idx in indices.items():
        rows = idx if last is None else idx[-last:]
        out[layer] = set(rows.reshape(-1).tolist())
    return out


class _RouterBank:
    """All target routers stacked, to route one batch of hidden states through every layer at once."""

    def __init__(self, target: nn.Module):
        from pdflash.offload.family import family_of

        layers = decoder_layers(target)
        self.family = family_of(target)
        self.top_k = self.family.top_k
        linears = [self.family.router_linear(layer) for layer in layers]
        norms = [layer.post_attention_layernorm for layer in layers]
        with torch.no_grad():
            self.weight = torch.stack([w.detach().float() for w, _ in linears])  # [L, E, H]
            self.bias = torch.stack([b.detach().float() if b is not None else torch.zeros(w.shape[0], device=w.device)
                                     for w, b in linears])  # [L, E] (zeros: a router without bias)
            self.norm_w = torch.stack([n.weight.detach().float() for n in norms])  # [L, H]
        self.eps = float(getattr(norms[0], "variance_epsilon", getattr(norms[0], "eps", 1e-5)))

    @torch.no_grad()
    def route(self, h: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """h [T, H] -> expert ids [len(layers), T, top_k] of each named layer's router."""
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, H]
        sel = torch.tensor(layers, device=self.weight.device)
        x = x.to(self.weight.device)[None] * self.norm_w[sel][:, None, :]  # [l, T, H]
        logits = torch.einsum("lth,leh->lte", x, self.weight[sel]) + self.bias[sel][:, None, :]
        return self.family.select(logits)


def window_for_cache(cache_slots: int, num_experts: int, top_k: int, block_size: int) -> int:
    """A route-ahead window (in layers) whose predictions fill at most half the expert cache.

    One verify pass of B tokens touches at most min(E, B * top_k) experts per layer; the other
    half of the cache is left to the experts in use and to on-demand misses.
    """
    per_layer = max(1, min(num_experts, block_size * top_k))
    return max(1, cache_slots // (2 * per_layer))


class Predictor:
    """Base predictor: each hook returns layer -> experts, or None when it has nothing to say."""

    name = "none"

    def before_draft(self) -> ExpertSets | None:
        return None

    def after_draft(self, draft_hidden: torch.Tensor) -> ExpertSets | None:
        return None

    def verify_hooks(self, target: nn.Module, submit: Callable[[ExpertSets], None]) -> list:
        return []

    def layer_start(self, layer: int, hidden: torch.Tensor, submit: Callable[[ExpertSets], None]) -> None:
        """Layer ``layer`` of the verify pass starts with ``hidden`` (the graphed decoder's hook)."""

    def observe(self, used: dict[int, torch.Tensor]) -> None:
        """Routing of the last target forward (prefill or verify): layer -> [T, k]."""


class DraftRouterPredictor(Predictor):
    name = "draft-router"

    def __init__(self, target: nn.Module):
        self.bank = _RouterBank(target)
        self.layers = list(range(self.bank.weight.shape[0]))

    def after_draft(self, draft_hidden: torch.Tensor) -> ExpertSets:
        ids = self.bank.route(draft_hidden.reshape(-1, draft_hidden.shape[-1]), self.layers).cpu()  # [L, B, k]
        return {l: set(ids[l].reshape(-1).tolist()) for l in self.layers}


class PreviousPredictor(Predictor):
    name = "previous"

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.last: ExpertSets | None = None

    def before_draft(self) -> ExpertSets | None:
        return self.last

    def observe(self, used: dict[int, torch.Tensor]) -> None:
        self.last = union_experts(used, last=self.block_size)


class LookaheadPredictor(Predictor):
    name = "lookahead"

    def __init__(self, target: nn.Module, depth: int):
        if depth < 1:
            raise PdflashError(f"lookahead depth must be at least 1, got {depth}")
        self.bank = _RouterBank(target)
        self.depth = depth

    def layer_start(self, layer: int, hidden: torch.Tensor, submit: Callable[[ExpertSets], None]) -> None:
        ahead = list(range(layer + 1, min(self.bank.weight.shape[0], layer + 1 + self.depth)))
        if not ahead:
            return
        ids = self.bank.route(hidden.reshape(-1, hidden.shape[-1]), ahead).cpu()  # [d, T, k]
        submit({l: set(ids[j].reshape(-1).tolist()) for j, l in enumerate(ahead)})

    def verify_hooks(self, target: nn.Module, submit: Callable[[ExpertSets], None]) -> list:
        layers = decoder_layers(target)

        def make(layer: int):
            def hook(module, args, kwargs):
                self.layer_start(layer, args[0] if args else kwargs["hidden_states"], submit)

            return hook

        return [layers[i].register_forward_pre_hook(make(i), with_kwargs=True) for i in range(len(layers))]


class UnionPredictor(Predictor):
    def __init__(self, parts: list[Predictor]):
        self.parts = parts
        self.name = "+".join(p.name for p in parts)

    @staticmethod
    def _merge(sets: list[ExpertSets | None]) -> ExpertSets | None:
        real = [s for s in sets if s]
        if not real:
            return None
        out: ExpertSets = {}
        for s in real:
            for layer, experts in s.items():
                out.setdefault(layer, set()).update(experts)
        return out

    def before_draft(self):
        return self._merge([p.before_draft() for p in self.parts])

    def after_draft(self, draft_hidden):
        return self._merge([p.after_draft(draft_hidden) for p in self.parts])

    def verify_hooks(self, target, submit):
        return [h for p in self.parts for h in p.verify_hooks(target, submit)]

    def layer_start(self, layer, hidden, submit):
        for p in self.parts:
            p.layer_start(layer, hidden, submit)

    def observe(self, used):
        for p in self.parts:
            p.observe(used)


def check_predictor_name(name: str) -> None:
    """Raise PdflashError unless ``name`` is a predictor, a '+'-joined union of them, or "none"."""
    if name == "none":
        return
    for part in name.split("+"):
        if part.strip() not in PREDICTORS:
            raise PdflashError(
                f"unknown route-ahead predictor {part.strip()!r}; choose from {', '.join(PREDICTORS)} "
                "(join with '+'), or none", exit_code=2
            )


def make_predictor(name: str, target: nn.Module, *, block_size: int, lookahead_depth: int = 2) -> Predictor:
    """``draft-router``, ``previous``, ``lookahead`` or a ``+``-joined union of them."""
    parts = []
    for part in name.split("+"):
        part = part.strip()
        if part == "draft-router":
            parts.append(DraftRouterPredictor(target))
        elif part == "previous":
            parts.append(PreviousPredictor(block_size))
        elif part == "lookahead":
            parts.append(LookaheadPredictor(target, lookahead_depth))
        else:
            raise PdflashError(f"unknown route-ahead predictor {part!r}; choose from {', '.join(PREDICTORS)} (join with '+')")
    return parts[0] if len(parts) == 1 else UnionPredictor(parts)


@dataclass
class RouteAheadReport:
    """Predicted vs used experts, summed over verify passes; lists are indexed by target layer."""

    predictor: str
    priority: int
    bytes_per_expert: int
    steps: int = 0
    predicted: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def add(self, predicted: ExpertSets, used: ExpertSets) -> None:
        self.steps += 1
        for layer in range(len(self.used)):
            p, u = predicted.get(layer, set()), used.get(layer, set())
            self.predicted[layer] += len(p)
            self.used[layer] += len(u)
            self.hits[layer] += len(p & u)

    @staticmethod
    def _ratio(a: int, b: int) -> float:
        return a / b if b else 0.0

    @property
    def recall(self) -> float:
        return self._ratio(sum(self.hits), sum(self.used))

    @property
    def precision(self) -> float:
        return self._ratio(sum(self.hits), sum(self.predicted))

    @property
    def useful_bytes(self) -> int:
        return sum(self.hits) * self.bytes_per_expert

    @property
    def wasted_bytes(self) -> int:
        return (sum(self.predicted) - sum(self.hits)) * self.bytes_per_expert

    def to_dict(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor,
            "priority": self.priority,
            "steps": self.steps,
            "predicted": sum(self.predicted),
            "used": sum(self.used),
            "hits": sum(self.hits),
            "recall": self.recall,
            "precision": self.precision,
            "bytes_per_expert": self.bytes_per_expert,
            "useful_bytes": self.useful_bytes,
            "wasted_bytes": self.wasted_bytes,
            "per_layer": [
                {
                    "layer": l,
                    "predicted": self.predicted[l],
                    "used": self.used[l],
                    "hits": self.hits[l],
                    "recall": self._ratio(self.hits[l], self.used[l]),
                    "precision": self._ratio(self.hits[l], self.predicted[l]),
                }
                for l in range(len(self.used))
            ],
        }


class RouteAhead:
    """Route-ahead for one target: predicts per step, submits to ``sink``, scores the predictions.

    Per speculative step the loop calls ``begin_step()``, ``after_draft(hidden)``, then runs the
    verify forward inside ``with verify():``. The prefill forward runs inside ``with prefill():``
    (it feeds predictors but is not scored). ``sink`` may be None to measure predictors alone.

    Pacing: a whole verify pass's experts can exceed a small device cache (24 layers x ~21
    experts against a few hundred slots), and prefetches of late layers would then evict the early
    ones before they are used. With ``window_layers`` = W, predictions of layers below W are handed
    over at once and those of layer L + W when layer L starts in the verify pass, so at most W
    layers of predictions wait in the cache. ``None`` hands over every layer at once.
    """

    def __init__(
        self,
        target: nn.Module,
        predictor: str,
        sink: PrefetchSink | None,
        *,
        block_size: int,
        priority: int = ROUTE_AHEAD_PRIORITY,
        bytes_per_expert: int = 0,
        lookahead_depth: int = 2,
        window_layers: int | None = None,
    ):
        if window_layers is not None and window_layers < 1:
            raise PdflashError(f"the route-ahead window must be at least 1 layer, got {window_layers}")
        self.target = target
        self.sink = sink
        self.priority = priority
        self.window = window_layers
        self.predictor = make_predictor(predictor, target, block_size=block_size, lookahead_depth=lookahead_depth)
        self.tap = RouterTap(target)
        self.num_layers = len(decoder_layers(target))
        n = self.num_layers
        self.report = RouteAheadReport(self.predictor.name, priority, int(bytes_per_expert),
                                       predicted=[0] * n, used=[0] * n, hits=[0] * n)
        self._predicted: ExpertSets = {}  # this step's predictions, all layers
        self._sent: ExpertSets = {}  # the part already handed to the sink
        self._horizon = n  # highest layer whose predictions may be handed over now
        self.submitted_last_step = 0  # (layer, expert) pairs handed to the sink in the last step

    def _add(self, sets: ExpertSets | None) -> None:
        for layer, experts in (sets or {}).items():
            self._predicted.setdefault(layer, set()).update(experts)
        self._flush()

    def _flush(self) -> None:
        new: dict[int, list[int]] = {}
        for layer, experts in self._predicted.items():
            if layer > self._horizon:
                continue
            sent = self._sent.setdefault(layer, set())
            fresh = sorted(experts - sent)
            if fresh:
                sent.update(fresh)
                new[layer] = fresh
        if new:
            self.submitted_last_step += sum(len(v) for v in new.values())
            if self.sink is not None:
                self.sink(new, self.priority)

    def begin_step(self) -> None:
        self._predicted, self._sent = {}, {}
        self._horizon = self.num_layers if self.window is None else self.window - 1
        self.submitted_last_step = 0
        self._add(self.predictor.before_draft())

    def after_draft(self, draft_hidden: torch.Tensor) -> None:
        self._add(self.predictor.after_draft(draft_hidden))

    @contextmanager
    def prefill(self) -> Iterator[None]:
        with self.tap.capture():
            yield
        self.predictor.observe(self.tap.take())

    def _pace(self, layer: int) -> None:
        if self.window is not None:
            self._horizon = max(self._horizon, layer + self.window)
            self._flush()

    def _pacing_hooks(self) -> list:
        if self.window is None:
            return []

        def make(layer: int):
            def hook(module, args):
                self._pace(layer)

            return hook

        return [block.register_forward_pre_hook(make(i)) for i, block in enumerate(decoder_layers(self.target))]

    @contextmanager
    def verify(self) -> Iterator[None]:
        handles = self._pacing_hooks() + self.predictor.verify_hooks(self.target, self._add)
        try:
            with self.tap.capture():
                yield
        finally:
            for h in handles:
                h.remove()
        used = self.tap.take()
        self.report.add(self._predicted, union_experts(used))
        self.predictor.observe(used)

    # -- the graphed decoder's forwards (pdflash.offload.graphs): no module hooks run there ---------
    @contextmanager
    def _routed(self, rt) -> Iterator[ExpertSets]:
        used: ExpertSets = {}

        def observer(layer: int, experts: list[int]) -> None:
            used.setdefault(layer, set()).update(experts)

        rt.add_routing_observer(observer)
        try:
            yield used
        finally:
            rt.remove_routing_observer(observer)

    @staticmethod
    def _as_rows(used: ExpertSets) -> dict[int, torch.Tensor]:
        """Per-layer unions as one-row index tensors (what ``Predictor.observe`` reads; the last
        B rows of a forward of T <= B tokens are all of it)."""
        return {l: torch.tensor([sorted(s)], dtype=torch.long) for l, s in used.items()}

    @contextmanager
    def prefill_on(self, decoder) -> Iterator[None]:
        """:meth:`prefill` for a forward of a ``GraphedDecoder`` (its runtime's routing observer)."""
        with self._routed(decoder.rt) as used:
            yield
        self.predictor.observe(self._as_rows(used))

    @contextmanager
    def verify_on(self, decoder) -> Iterator[None]:
        """:meth:`verify` for a forward of a ``GraphedDecoder``: pacing and lookahead through its
        ``layer_hooks``, the experts used through its runtime's routing observer."""
        def hook(layer: int, hidden: torch.Tensor) -> None:
            self._pace(layer)
            self.predictor.layer_start(layer, hidden, self._add)

        decoder.layer_hooks.append(hook)
        try:
            with self._routed(decoder.rt) as used:
                yield
        finally:
            decoder.layer_hooks.remove(hook)
        self.report.add(self._predicted, used)
        self.predictor.observe(self._as_rows(used))

    def close(self) -> None:
        self.tap.close()
