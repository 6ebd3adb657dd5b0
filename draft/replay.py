"""A link-bound decoding regime simulated on the CPU, to replay the block planner.

The H100 regime of session 19 (docs/benchmarks.md), scaled to 4 layers of 32 experts, top-4: a
verify forward's own work 23 ms whatever its length, a draft pass 4.6 ms, each missing expert
1.9 ms of link, a cache that keeps each layer's 8 most recently used experts (what balanced
eviction keeps of a layer at a 25 % cache), random routes, oracle acceptance P per position
(each text position is draftable with probability P, drawn once per position from its own
random stream, so every arm of a seed meets the same text; a proposal is right up to the first
position that is not). No model runs: a replay takes milliseconds,
so a planner change can be read over many seeds before a GPU run (``benchmarks/replay_planner.py``,
and the planner's tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pdflash.draft.planner import BlockPlanner
from pdflash.offload.cost import CostModel

LAYERS, EXPERTS, TOP_K = 4, 32, 4
EXPERT_BYTES = 1_000_000
FORWARD_S = 0.023  # a verify forward's own work, any length
DRAFT_S = 0.0046  # a draft pass
EXPERT_S = 0.0019  # link time per missing expert
MAX_BLOCK = 8


class RecentCache:
    """Each layer keeps its ``keep`` most recently used experts; ``use`` returns how many of a
    step's experts were missing. Answers ``held`` as the runtime's cache does."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.capacity = LAYERS * keep
        self.recent: dict[int, list[int]] = {}

    def held(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        return {(layer, e) for layer, es in self.recent.items() for e in es}, set()

    def use(self, layer: int, experts) -> int:
        recent = self.recent.setdefault(layer, [])
        missing = sum(e not in recent for e in experts)
        recent[:] = [e for e in recent if e not in experts] + list(experts)
        del recent[: max(0, len(recent) - self.keep)]
        return missing


def route_block(planner: BlockPlanner, rng: random.Random, block: int, cache=None) -> int:
    """Random top-k routes of ``block`` tokens in every layer, handed to the planner; returns the
    misses: the whole union, or what ``cache`` (a :class:`RecentCache`) did not hold."""
    misses = 0
    for layer in range(LAYERS):
        union: set[int] = set()
        for _ in range(block):
            union |= set(rng.sample(range(EXPERTS), TOP_K))
        planner.on_routed(layer, sorted(union))
        misses += len(union) if cache is None else cache.use(layer, sorted(union))
    return misses


@dataclass
class Replay:
    planner: BlockPlanner
    tokens: int = 0
    seconds: float = 0.0
    steps: list[tuple[int, int, bool]] = field(default_factory=list)  # (block, accepted, shadow probe)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def link_bound_run(p_accept: float, seed: int, *, steps: int | None = None, horizon: int | None = None,
                   fixed: int | None = None, decided_ahead: bool = True, **planner_kw) -> Replay:
    """Decode ``steps`` steps, or until ``horizon`` tokens are committed, with the planner
    (``planner_kw``: BlockPlanner keyword arguments) choosing each block, or every block of
    length ``fixed``. ``decided_ahead``: a step ``decide_plain`` decides plain skips begin_step
    and plan_draft, as the decode loop does."""
    if (steps is None) == (horizon is None):
        raise ValueError("give steps or horizon")
    rng = random.Random(seed)  # routes
    text = random.Random(seed + 1_000_003)  # which positions the draft gets right, the same for every arm
    draftable: list[bool] = []
    moved = [0.0, 0.0]
    cost = CostModel(EXPERT_BYTES, link_gbps=EXPERT_BYTES / EXPERT_S / 1e9)
    cache = RecentCache()
    p = BlockPlanner(MAX_BLOCK, cost, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, cache=cache,
                     link_counters=lambda: tuple(moved), **planner_kw)
    out = Replay(p)
    pos = 0
    while (len(out.steps) < steps) if steps is not None else (out.tokens < horizon):
        if decided_ahead and not fixed and p.decide_plain(MAX_BLOCK):
            b = 1  # decided ahead: no begin_step, plan_draft or draft
        else:
            p.begin_step()
            b = p.plan_draft(MAX_BLOCK, can_shadow=True)
        if fixed:
            b = fixed
            p.shadow_block, p.draft_block = 0, (b if b > 1 else 0)
        drafted = max(b, p.draft_block, p.shadow_block)
        if drafted > 1:
            p.after_draft(drafted, DRAFT_S)
        misses = route_block(p, rng, b, cache=cache)
        moved[0] += misses * EXPERT_BYTES
        moved[1] += misses * EXPERT_S
        while len(draftable) < pos + drafted + 1:
            draftable.append(text.random() < p_accept)
        run = 0  # proposals right up to the first position the draft misses, wrong after it (as oracle mode checks them)
        while run < drafted - 1 and draftable[pos + 1 + run]:
            run += 1
        proposals = [pos + 1 + i if i < run else -1 for i in range(drafted - 1)]
        if p.shadow_block:  # a shadow probe: checked against the tokens committed from this step on
            p.shadow_proposals(proposals)
        acc = min(run, b - 1)
        seconds = DRAFT_S * (drafted > 1) + FORWARD_S + misses * EXPERT_S
        out.steps.append((b, acc, bool(p.shadow_block)))
        p.end_step(b, acc, acc + 1, seconds, draft_seconds=DRAFT_S if drafted > 1 else 0.0,
                   tokens=list(range(pos + 1, pos + acc + 2)),
                   tail=proposals[b - 1:] if drafted > b and not p.shadow_block else ())
        pos += acc + 1
        out.tokens += acc + 1
        out.seconds += seconds
    return out
