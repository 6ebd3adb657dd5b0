"""ExpertPrefetcher: put predicted experts into the cache before the forward needs them.

Sources of predictions, each with its band (lower = served first):

- explicit lists, ``prefetch_experts({layer: experts})``, at ``route_ahead_priority``
  (default Band.ROUTE_AHEAD): what a caller such as a speculative decoder knows
  ahead of the verify pass;
- lookahead routing (``lookahead_depth`` d > 0), at ``route_ahead_priority``: when
  decoder layer L starts, the routers of layers L+1..L+d are applied to the
  hidden state entering layer L (through each target layer's own
  post-attention norm), and the union of their top-k over the tokens is fetched
  as soon as layer L has routed. The predictions travel to the host with layer L's
  own routing copy (one device->host synchronisation per layer, lookahead or not);
  a copy of their own at layer start would stall the host until the device caught up;
- history / frequency (``history_depth`` d > 0), at ``background_priority``: the
  ``history_experts`` most used experts (use counts decayed by ``history_decay``
  per forward) of layers L+1..L+d; at the last layer it predicts layers 0..d-1 of
  the next forward (wrap-around).

When layer L starts, queued prefetches (band >= 1) of layers below L are
cancelled: they were not needed in time. Predictions are scored against the
experts each layer then really used (recall, precision per predictor).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.native import NUM_PRIORITY, Band
from pdflash.offload.cache import ExpertCache


class ExpertPrefetcher:
    """See the module docstring. Driven by the runtime's layer hooks (one thread)."""

    def __init__(
        self,
        cache: ExpertCache,
        family,
        model: nn.Module,
        *,
        route_ahead_priority: int = Band.ROUTE_AHEAD,
        background_priority: int = Band.BACKGROUND,
        lookahead_depth: int = 0,
        history_depth: int = 0,
        history_experts: int | None = None,
        history_decay: float = 0.8,
    ):
        for name, p in (("route_ahead_priority", route_ahead_priority), ("background_priority", background_priority)):
            if not 1 <= int(p) < NUM_PRIORITY:
                raise PdflashError(f"{name} must be a prefetch band in [1, {NUM_PRIORITY}), got {p}")
        if lookahead_depth < 0 or history_depth < 0:
            raise PdflashError("lookahead and history depths must be >= 0")
        self.cache = cache
        self.family = family
        self.model = model
        self.num_layers = family.num_layers
        self.num_experts = family.num_experts
        self.route_ahead_priority = int(route_ahead_priority)
        self.background_priority = int(background_priority)
        self.lookahead_depth = min(lookahead_depth, self.num_layers - 1)
        self.history_depth = min(history_depth, self.num_layers)
        self.history_experts = history_experts or family.top_k
        self.history_decay = history_decay
        self.reset()

    def reset(self) -> None:
        self._freq = torch.zeros(self.num_layers, self.num_experts)  # decayed use counts
        self._predicted: dict[int, dict[str, set[int]]] = {}  # layer -> predictor -> experts
        self._score: dict[str, list[int]] = {}  # predictor -> [predicted, used, correct]
        self._lookahead_pending: tuple[list[int], torch.Tensor] | None = None  # (layers, top-k on its way to the host)
        self.cache.protected.clear()

    # -- explicit lists ----------------------------------------------------------------
    def prefetch_experts(self, plan: dict[int, Iterable[int]], priority: int | None = None) -> int:
        """Prefetch {layer: experts} at ``priority`` (default route_ahead_priority); returns copies submitted.

        Layers are fetched in ascending order (the forward needs them in that order).
        """
        band = self.route_ahead_priority if priority is None else int(priority)
        if not 0 <= band < NUM_PRIORITY:
            raise PdflashError(f"priority must be in [0, {NUM_PRIORITY}), got {priority}")
        n = 0
        for layer in sorted(plan):
            if not 0 <= layer < self.num_layers:
                raise PdflashError(f"layer {layer} is out of range [0, {self.num_layers})")
            experts = sorted(set(int(e) for e in plan[layer]))
            if any(not 0 <= e < self.num_experts for e in experts):
                raise PdflashError(f"layer {layer}: experts must be in [0, {self.num_experts}), got {experts}")
            self._note("route-ahead", layer, experts)
            for e in experts:
                n += self.cache.prefetch(layer, e, band)
        return n

    # -- runtime hooks -----------------------------------------------------------------
    def on_layer_start(self, layer: int, hidden: torch.Tensor) -> None:
        """Decoder layer ``layer`` is about to run on ``hidden`` [..., H] (the residual stream)."""
        self.cache.cancel_passed(layer)
        if self.lookahead_depth:
            self._lookahead(layer, hidden)
        if self.history_depth:
            self._history(layer)

    def on_layer_routed(self, layer: int, experts: list[int]) -> None:
        """The forward of ``layer`` used ``experts`` (called right after its routing reached the
        host): submit the lookahead prefetches computed at its start, score predictions, update history."""
        if self._lookahead_pending is not None:
            self._submit_lookahead(*self._lookahead_pending)
            self._lookahead_pending = None
        used = set(experts)
        for name, pred in self._predicted.pop(layer, {}).items():
            sc = self._score.setdefault(name, [0, 0, 0])
            sc[0] += len(pred)
            sc[1] += len(used)
            sc[2] += len(pred & used)
        if self.cache.protected:
            self.cache.protected -= {(layer, e) for e in range(self.num_experts)}
        if self.history_depth:
            row = self._freq[layer]
            row.mul_(self.history_decay)
            row[experts] += 1.0

    # -- predictors --------------------------------------------------------------------
    def _lookahead(self, layer: int, hidden: torch.Tensor) -> None:
        targets = [m for m in range(layer + 1, layer + 1 + self.lookahead_depth) if m < self.num_layers]
        if not targets:
            return
        h = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            top = torch.stack([self.family.router_topk(self.model, m, h) for m in targets])  # [d, T, K]
        # queued behind this layer's attention; complete once the layer's routing copy has synchronised
        self._lookahead_pending = (targets, top.to("cpu", non_blocking=True))

    def _submit_lookahead(self, targets: list[int], top: torch.Tensor) -> None:
        for i, m in enumerate(targets):
            experts = sorted(set(top[i].reshape(-1).tolist()))
            self._note("lookahead", m, experts)
            for e in experts:
                self.cache.prefetch(m, e, self.route_ahead_priority)

    def _history(self, layer: int) -> None:
        last = self.num_layers - 1
        if layer == last:  # wrap-around: the next forward's first layers
            targets = list(range(0, self.history_depth))
        else:
            targets = [m for m in range(layer + 1, layer + 1 + self.history_depth) if m <= last]
        for m in targets:
            row = self._freq[m]
            if not bool(row.any()):
                continue
            k = min(self.history_experts, int((row > 0).sum()))
            experts = sorted(torch.topk(row, k).indices.tolist())
            self._note("history", m, experts)
            for e in experts:
                self.cache.prefetch(m, e, self.background_priority)

    def _note(self, predictor: str, layer: int, experts: list[int]) -> None:
        self._predicted.setdefault(layer, {}).setdefault(predictor, set()).update(experts)
        self.cache.protected.update((layer, e) for e in experts)

    # -- reporting ---------------------------------------------------------------------
    def accuracy(self) -> dict[str, dict]:
        """{predictor: {predicted, used, correct, recall, precision}} over the layers it predicted."""
        out = {}
        for name, (pred, used, correct) in sorted(self._score.items()):
            out[name] = {
                "predicted": pred,
                "used": used,
                "correct": correct,
                "recall": correct / used if used else None,
                "precision": correct / pred if pred else None,
            }
        return out

    def settings(self) -> dict:
        return {
            "route_ahead_priority": self.route_ahead_priority,
            "background_priority": self.background_priority,
            "lookahead_depth": self.lookahead_depth,
            "history_depth": self.history_depth,
            "history_experts": self.history_experts,
        }
