"""Per-step choice of the verify block length B for speculative decoding (``--block-size auto``).

A verify block of B tokens commits 1 + a_1 + a_1 a_2 + ... + a_1 ... a_(B-1) tokens in
expectation (a_i: acceptance of draft position i given the positions before it were accepted)
and costs a draft forward (none for B = 1) plus a verify forward whose experts are the union of
its B tokens' experts. The planner picks the B in 1 .. max_block with the most expected committed
tokens per predicted second; B = 1 is plain decoding (no draft forward). Each step has two stages:

1. before drafting (:meth:`BlockPlanner.plan_draft`): with the acceptance expected per position
   (the running per-position acceptance, or stage 2's calibrated estimates of recent drafts), is
   any B > 1 expected to beat B = 1 once the draft's cost is paid? If not, the step is a
   plain one and the draft does not run. Once measured, what recent steps realized decides
   instead of the prediction: the draft runs while the steps that ran it (an EWMA of their
   committed tokens per second, the draft's cost and its refused proposals included) beat
   steady plain decoding, and not otherwise. After ``probe_every`` plain steps in a row the draft runs
   anyway and at least one proposal is verified, so the acceptance figures keep being measured
   (the interval doubles after each probe while plain decoding stays ahead, so probes cost a
   bounded share of a long plain stretch); when the last committed tokens repeat an earlier
   stretch of the sequence, the probe comes early (at most every ``min_repeat_gap`` plain steps,
   a gap that doubles after each such probe whose proposals were all refused);
   every ``remeasure_plain_every`` speculative steps in a row two plain steps run, so B = 1's
   time stays measured too (both count as ``probes``). Whatever the predictions, a block length
   whose recent steps realized fewer tokens per second (an EWMA) than steady plain decoding is
   not chosen (except by a probe when every speculative length lags).
2. after drafting (:meth:`BlockPlanner.choose`): the same choice with the draft's own confidence
   per position (its probability of the token it proposed), calibrated against measured
   acceptance in confidence bins, each bin's prior being the position's running acceptance.

B = 1 is priced by what plain decoding measurably costs once it runs: the median of recent
plain steps that followed a plain step (the steady state, whose expert cache holds the recent
tokens' experts), as soon as there is one. The first plain step after speculative ones pays for
the cache the wider verify blocks left behind, and is not taken as the price of plain decoding.

Costs come from the shared :class:`~pdflash.offload.cost.CostModel`: forward times per B (EWMA of
measured step times with the step's own link time removed) and the link rate (the scheduler's
counters). The experts a block will fetch are predicted from route-ahead's ``previous`` rule: the
union of the experts of the last B committed positions, per layer, checked against the cache
(resident, in flight, missing), plus a per-B correction measured as the EWMA of (experts actually
fetched - experts predicted missing); before B is measured that correction comes from the nearest
measured B scaled by the expected number of distinct experts, or from the cache's share of all
experts. Cold start: the first two plain steps (the second prices steady plain decoding), then
one block of half the draft's length after a full draft (a full block can cost several plain
steps' fetches); other lengths are predicted from the nearest measured one plus the link time of
their predicted experts until measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdflash.offload.cost import CostModel, Ewma, RecentMedian


def distinct_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts per layer touched by ``tokens`` tokens routing top-k of E at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_committed(probs: Sequence[float], block: int) -> float:
    """1 + p_1 + p_1 p_2 + ... over the first block - 1 conditional acceptances."""
    total, run = 1.0, 1.0
    for p in probs[: block - 1]:
        run *= p
        total += run
    return total


class AcceptanceModel:
    """Measured acceptance per draft position, and calibration of the draft's confidence.

    Position i (1-based) has ``reached[i]`` (blocks in which positions 1 .. i-1 were accepted and
    i was drafted) and ``accepted[i]``; its conditional acceptance is the Beta posterior mean
    (accepted + w m) / (reached + w), prior mean m and weight w. Confidence bins (``bins`` equal
    slices of [0, 1]) count the same per proposal; a proposal's calibrated acceptance is its bin's
    posterior mean with its position's conditional acceptance as the prior mean.
    """

    def __init__(self, positions: int, prior_mean: float = 0.5, prior_weight: float = 1.0, bins: int = 10):
        self.positions = positions
        self.prior_mean = prior_mean
        self.prior_weight = prior_weight
        self.reached = [0] * positions
        self.accepted = [0] * positions
        self.bins = bins
        self.bin_reached = [0] * bins
        self.bin_accepted = [0] * bins

    def _bin(self, conf: float) -> int:
        return min(self.bins - 1, max(0, int(conf * self.bins)))

    def conditional(self) -> list[float]:
        w, m = self.prior_weight, self.prior_mean
        return [(a + w * m) / (r + w) for a, r in zip(self.accepted, self.reached)]

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        cond = self.conditional()
        w = self.prior_weight
        out = []
        for i, c in enumerate(confidence[: self.positions]):
            b = self._bin(float(c))
            out.append((self.bin_accepted[b] + w * cond[i]) / (self.bin_reached[b] + w))
        return out

    def record(self, drafted: int, accepted: int, confidence: Sequence[float] | None = None) -> None:
        """A block verified ``drafted`` proposals and accepted the first ``accepted``."""
        for i in range(min(drafted, accepted + 1, self.positions)):
            ok = i < accepted
            self.reached[i] += 1
            self.accepted[i] += ok
            if confidence is not None and i < len(confidence):
                b = self._bin(float(confidence[i]))
                self.bin_reached[b] += 1
                self.bin_accepted[b] += ok


@dataclass
class Choice:
    """One stage's decision: the block length, and what the planner expected of it."""

    block: int
    expected_tokens: float
    predicted_seconds: float | None
    fetch_experts: float  # experts' worth of link time predicted for the block
    route_missing: float  # the part of it from the route-ahead set's missing / in-flight experts


@dataclass
class PlannerReport:
    histogram: dict[int, int] = field(default_factory=dict)  # chosen B -> steps
    probes: int = 0  # drafts run only to keep measuring acceptance
    predicted_seconds: float = 0.0  # summed over steps that had a prediction
    measured_seconds: float = 0.0  # the same steps, measured
    predicted_steps: int = 0
    abs_error_seconds: float = 0.0
    fetched_experts: float = 0.0
    committed_tokens: int = 0
    clock: str = "wall"  # what step times are measured in ("process_time": CPU seconds of the process)

    def to_dict(self) -> dict:
        n = self.predicted_steps
        return {
            "block_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "probes": self.probes,
            "predicted_step_ms": 1e3 * self.predicted_seconds / n if n else None,
            "measured_step_ms": 1e3 * self.measured_seconds / n if n else None,
            "step_time_abs_error_ms": 1e3 * self.abs_error_seconds / n if n else None,
            "predicted_steps": n,
            "step_clock": self.clock,
            "fetched_experts_per_committed_token": self.fetched_experts / self.committed_tokens
            if self.committed_tokens else None,
        }


class BlockPlanner:
    """See the module docstring.

    ``cache`` (an ExpertCache, or None without offloading) answers resident / in flight;
    ``moved_bytes`` returns the link's cumulative bytes and ``link_counters`` (bytes, busy seconds)
    feeds the cost model's link rate; both None without a scheduler. ``use_confidence`` False
    ignores the draft's confidence (oracle mode, whose proposals are not the draft's). ``clock``
    (e.g. ``time.process_time``) makes the planner time the steps itself; without it (what
    generate does) the caller's wall-clock step times are used.
    """

    def __init__(
        self,
        max_block: int,
        cost: CostModel,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        cache=None,
        link_counters: Callable[[], tuple[float, float]] | None = None,
        use_confidence: bool = True,
        probe_every: int = 16,
        min_repeat_gap: int = 4,
        remeasure_plain_every: int = 16,
        acceptance: AcceptanceModel | None = None,
        clock: Callable[[], float] | None = None,
    ):
        if max_block < 1:
            raise ValueError(f"max_block must be at least 1, got {max_block}")
        self.max_block = max_block
        self.cost = cost
        self.cache = cache
        self.link_counters = link_counters
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.use_confidence = use_confidence
        self.clock = clock  # None: the step times the caller passes; else the planner times steps itself
        self._t0 = 0.0
        self.probe_every = probe_every
        self.min_repeat_gap = min_repeat_gap
        self._repeat_gap = min_repeat_gap  # doubles after each repeat probe that accepted nothing
        self._repeat_probe = False
        self._probe_interval = probe_every  # doubles after each probe that leaves plain decoding ahead
        self.remeasure_plain_every = remeasure_plain_every
        self._spec_run = 0  # speculative steps in a row
        self.acceptance = acceptance or AcceptanceModel(max(1, max_block - 1))
        self._expected = [Ewma() for _ in range(self.acceptance.positions)]  # stage 2's calibrated p_i, smoothed
        self._history: deque[tuple[int, dict[int, set[int]]]] = deque(maxlen=max_block)  # (tokens, layer -> experts) per step
        self._current: dict[int, set[int]] = {}
        self._extra: dict[int, Ewma] = {}  # B -> EWMA(fetched - predicted missing)
        self._plain_run = 0
        self._plain_steady = RecentMedian()  # measured plain steps that followed a plain step
        self._prev_block: int | None = None
        self._forced_plain = 0  # plain steps still to run for a re-measurement
        self._rate: dict[int, Ewma] = {}  # B -> committed tokens per second its steps realized
        self._spec_rate = Ewma(0.5)  # committed tokens per second of recent steps that ran the draft
        self._drafting = False  # stage 1 of the step running now ran the draft
        self._step_bytes0 = 0.0
        self._stage: Choice | None = None
        self._probe = False
        self._draft_clock = 0.0
        self.last_measured_seconds: float | None = None  # the last step, in the planner's clock
        self.report = PlannerReport(clock="wall" if clock is None else getattr(clock, "__name__", "custom"))

    # -- inputs ----------------------------------------------------------------------
    def on_routed(self, layer: int, experts: Sequence[int]) -> None:
        """A target layer routed to ``experts`` (the runtime's routing observer): collected for
        the step running now, which :meth:`end_step` files with the tokens it committed."""
        self._current.setdefault(int(layer), set()).update(int(e) for e in experts)

    def _bytes_now(self) -> tuple[float, float] | None:
        return self.link_counters() if self.link_counters is not None else None

    # -- predictions -------------------------------------------------------------------
    def _route_missing(self, limit: int) -> list[float]:
        """Route-ahead's ``previous`` rule for B = 1 .. ``limit`` in one pass: the experts of the
        latest steps that cover B committed tokens, as experts' worth of link time still to come
        (missing, or in flight at ``in_flight_weight``) against the cache now; index B - 1."""
        out: list[float] = []
        seen: set[tuple[int, int]] = set()
        in_flight = missing = covered = 0
        for tokens, experts in reversed(self._history):
            for layer, es in experts.items():
                for e in es:
                    key = (layer, e)
                    if key in seen:
                        continue
                    seen.add(key)
                    state = self.cache.state_of(layer, e)
                    if state == "arriving":
                        in_flight += 1
                    elif state != "resident":
                        missing += 1
            covered += tokens
            value = self.cost.fetch_equivalents(in_flight, missing)
            while len(out) < min(covered, limit):
                out.append(value)
            if len(out) >= limit:
                break
        value = self.cost.fetch_equivalents(in_flight, missing)
        return out + [value] * (limit - len(out))

    def _extra_fetch(self, block: int) -> float:
        known = {b: e.value for b, e in self._extra.items() if e.value is not None}
        u = distinct_experts(block, self.num_experts, self.top_k)
        if block in known:
            return known[block]
        if known:
            near = min(known, key=lambda b: (abs(b - block), b))
            return known[near] * u / distinct_experts(near, self.num_experts, self.top_k)
        if self.cache is None:
            return 0.0
        share = min(1.0, self.cache.capacity / float(self.num_layers * self.num_experts))
        return self.num_layers * u * (1.0 - share)

    def fetch_experts(self, block: int) -> tuple[float, float]:
        """(predicted missing of the route-ahead set, total experts' worth of link time) for B."""
        if self.cache is None:
            return 0.0, 0.0
        pred = self._route_missing(block)[block - 1]
        return pred, max(0.0, pred + self._extra_fetch(block))

    def _candidates(self, low: int, limit: int, probs: Sequence[float], draft_s: float | None) -> list[Choice]:
        route = self._route_missing(limit) if self.cache is not None else [0.0] * limit
        out = []
        for block in range(low, limit + 1):
            route_missing = route[block - 1]
            fetch = max(0.0, route_missing + self._extra_fetch(block)) if self.cache is not None else 0.0
            verify = self.cost.step_seconds("verify", block, fetch)
            if block == 1 and self._plain_steady.value is not None:
                t = self._plain_steady.value  # measured, fetches included
            elif verify is None:
                t = None
            elif block == 1:
                t = verify
            else:
                t = None if draft_s is None else draft_s + verify
            out.append(Choice(block, expected_committed(probs, block), t, fetch, route_missing))
        return out

    def _candidate(self, block: int, probs: Sequence[float], draft_s: float | None) -> Choice:
        return self._candidates(block, block, probs, draft_s)[0]

    def _best(self, limit: int, probs: Sequence[float], draft_s: float | None, low: int = 1) -> Choice:
        cands = self._candidates(low, limit, probs, draft_s)
        measured = self.cost.measured_forward("verify")
        if low == 1 and (1 not in measured or self._plain_steady.value is None):
            return cands[0]  # cold start: two plain steps first (the second is a steady one) ...
        if len(cands) > 1 and (max(measured, default=0) < 2 or draft_s is None):
            half = max(2, (cands[-1].block + 1) // 2)  # ... then a block of half the draft: informative, and
            return next(c for c in cands if c.block >= min(half, cands[-1].block))  # half the full block's fetches
        keep = [c for c in cands if not self._lags(c.block)] or cands  # a probe keeps them all if all lag
        return max(keep, key=lambda c: (c.expected_tokens / max(c.predicted_seconds or 0.0, 1e-12), -c.block))

    def _lags(self, block: int) -> bool:
        """Block length ``block`` > 1 recently committed fewer tokens per second than steady plain
        decoding does: whatever the predictions say, the realized rate rules it out (the guard
        that keeps auto from being slower than plain decoding when the cost model is wrong)."""
        rate, plain = self._rate.get(block), self._plain_steady.value
        return block > 1 and rate is not None and rate.count >= 2 and bool(plain) and rate.value < 1.0 / plain

    # -- the two stages ------------------------------------------------------------------
    def begin_step(self) -> None:
        self._current = {}
        self._draft_clock = 0.0
        if self.clock is not None:
            self._t0 = self.clock()
        c = self._bytes_now()
        self._step_bytes0 = c[0] if c is not None else 0.0

    def plan_draft(self, limit: int, repeating: bool = False) -> int:
        """Stage 1: the draft length to run now, ``limit`` (<= max_block) or 1 for a plain step.
        ``repeating``: the last committed tokens already occurred earlier in the sequence (text
        that copies itself is where a draft is most often right); during a plain stretch it
        brings the next probe forward (at most every ``min_repeat_gap`` plain steps, doubling
        after each such probe that accepted nothing)."""
        self._stage = None
        self._probe = self._repeat_probe = self._drafting = False
        if limit <= 1 or self._forced_plain > 0:
            self._forced_plain = max(0, self._forced_plain - 1)
            self._stage = self._candidate(1, [], None)
            self._plain_run += 1
            self._spec_run = 0
            return 1
        draft_s = self.cost.forward_seconds("draft", limit)
        realized = self._speculation_pays()
        if realized is None:
            best = self._best(limit, self._stage1_probs(), draft_s)
        else:
            # What recent steps realized outranks what the model predicts: draft while drafting
            # has committed more tokens per second than steady plain decoding, else decode plainly.
            best = self._candidate(limit if realized else 1, self._stage1_probs(), draft_s)
        if best.block == 1 and self._plain_run + 1 >= self._probe_interval:
            self.report.probes += 1
            self._probe_interval *= 2
            self._probe = True  # stage 2 then verifies at least one proposal
            best = self._candidate(limit, self._stage1_probs(), draft_s)
        elif best.block == 1 and repeating and self._plain_run + 1 >= self._repeat_gap:
            self.report.probes += 1  # the text repeats itself: look now, the interval unchanged
            self._probe = self._repeat_probe = True
            best = self._candidate(limit, self._stage1_probs(), draft_s)
        elif best.block > 1 and self._spec_run + 1 >= self.remeasure_plain_every:
            self.report.probes += 1  # two plain steps keep B = 1's steady time measured
            self._forced_plain = 1
            best = self._candidate(1, [], None)
        self._stage = best
        if best.block == 1:
            self._plain_run += 1
            self._spec_run = 0
            return 1
        if not self._probe:
            self._probe_interval = self.probe_every  # speculation pays again: probe at the base rate
        self._plain_run = 0
        self._spec_run += 1
        self._drafting = True
        return limit

    def _speculation_pays(self) -> bool | None:
        """Whether the recent steps that ran the draft committed more tokens per second than
        steady plain decoding (None until both are measured)."""
        plain = self._plain_steady.value
        if self._spec_rate.value is None or not plain:
            return None
        return self._spec_rate.value > 1.0 / plain

    def _stage1_probs(self) -> list[float]:
        """Acceptance expected before drafting: the running per-position acceptance, or, with the
        draft's confidence in use, stage 2's calibrated estimates smoothed over the drafted steps
        (so a draft whose confidence keeps stage 2 at B = 1 stops being run)."""
        cond = self.acceptance.conditional()
        if not self.use_confidence:
            return cond
        return [e.value if e.value is not None else c for e, c in zip(self._expected, cond)]

    def choose(self, drafted: int, confidence: Sequence[float] | None, draft_seconds: float) -> Choice:
        """Stage 2, after a draft of ``drafted`` tokens (B <= drafted): the verify length."""
        if self.clock is not None:
            draft_seconds = self.clock() - self._t0
            self._draft_clock = draft_seconds
        self.cost.observe_forward("draft", drafted, draft_seconds)
        if confidence is not None and self.use_confidence:
            probs = self.acceptance.calibrated(confidence)
            for e, p in zip(self._expected, probs):
                e.add(p)
        else:
            probs = self.acceptance.conditional()
        best = self._best(drafted, probs, draft_seconds, low=2 if self._probe and drafted >= 2 else 1)
        self._stage = best
        return best

    def current(self) -> Choice | None:
        """The choice the step is running (stage 2's, or stage 1's for a plain step)."""
        return self._stage

    def end_step(self, block: int, accepted: int, committed: int, seconds: float,
                 confidence: Sequence[float] | None = None, draft_seconds: float = 0.0) -> None:
        """The step verified ``block`` tokens, accepted ``accepted`` proposals, committed
        ``committed`` tokens and took ``seconds`` (draft + verify; with a ``clock`` the planner's
        own measurements replace ``seconds`` and ``draft_seconds``)."""
        if self.clock is not None:
            seconds = self.clock() - self._t0
            draft_seconds = self._draft_clock
        self.last_measured_seconds = seconds
        if self._drafting or block > 1:  # the step ran the draft
            if seconds > 0:
                self._spec_rate.add(committed / seconds)
                if block > 1:
                    self._rate.setdefault(block, Ewma(0.5)).add(committed / seconds)
        elif block == 1 and self._prev_block == 1:
            self._plain_steady.add(seconds)
        self._prev_block = block
        counters = self._bytes_now()
        fetched = 0.0
        if counters is not None:
            fetched = max(0.0, counters[0] - self._step_bytes0) / self.cost.expert_bytes
            self.cost.observe_link(*counters)
        choice = self._stage if self._stage is not None and self._stage.block == block else None
        self.cost.observe_forward("verify", block, max(0.0, seconds - draft_seconds), fetched)
        if self.cache is not None:
            pred_missing = choice.route_missing if choice is not None else 0.0
            self._extra.setdefault(block, Ewma(self.cost.alpha)).add(fetched - pred_missing)
        if block > 1:
            self.acceptance.record(block - 1, accepted, confidence if self.use_confidence else None)
        if self._repeat_probe:  # repetition that the draft did not follow: trust the hint less
            self._repeat_gap = self.min_repeat_gap if accepted else min(64, 2 * self._repeat_gap)
        self._history.append((committed, self._current))
        self._current = {}
        r = self.report
        r.histogram[block] = r.histogram.get(block, 0) + 1
        r.fetched_experts += fetched
        r.committed_tokens += committed
        if choice is not None and choice.predicted_seconds is not None:
            r.predicted_steps += 1
            r.predicted_seconds += choice.predicted_seconds
            r.measured_seconds += seconds
            r.abs_error_seconds += abs(choice.predicted_seconds - seconds)

    def to_dict(self) -> dict:
        return {**self.report.to_dict(), "acceptance_conditional": self.acceptance.conditional(),
                "cost": self.cost.to_dict()}
