"""Per-step choice of the verify block length B for speculative decoding (``--block-size auto``).

A verify block of B tokens commits 1 + a_1 + a_1 a_2 + ... + a_1 ... a_(B-1) tokens in
expectation (a_i: acceptance of draft position i given the positions before it were accepted)
and costs a draft forward of B positions (none for B = 1) plus a verify forward whose experts are
the union of its B tokens' experts. Its rate is expected committed tokens per predicted second;
B = 1 is plain decoding.

Each step (:meth:`BlockPlanner.plan_draft`) the planner keeps running its current block length,
the *incumbent*, unless another B's predicted rate beats the incumbent's by a margin:
``spec_margin`` between two speculative lengths (default: ``switch_margin``, 15 %),
``plain_margin`` (30 %) to leave speculation for plain decoding, and ``switch_margin`` to come
back. A smaller margin between speculative lengths was measured (session 20, docs/benchmarks.md):
on an H100 at P = 0.9 blocks of 4 priced 14.9 % ahead of the incumbent blocks of 2 (measured
1.49x plain decoding against the planner's 1.22x) were kept out by the 15 % margin, but at 5 % the
embedded pair on a CPU switched on noise ("def fibonacci(n):" 0.82-1.12x plain decoding).
Instead, a speculative length priced more than ``trial_margin`` (5 %) but less than the margin
ahead of the speculative incumbent is *tried*: it runs ``trial_blocks`` (4) blocks, and stays the
incumbent only if they realize more tokens per second than the incumbent's own recent blocks did;
otherwise the incumbent comes back and that length is not tried for ``trial_cooldown`` (32)
steps. The realized rate, not a narrower margin on predictions, decides. The same holds between
plain decoding and a speculative length priced 5-15 % ahead of it (``trial_from_plain``): its
trial blocks must beat steady plain decoding's measured rate.

The whole chosen block is verified (the draft drafts it, or up to twice it: overdraft, below).
Why margins: acceptance varies along a text (the draft sees little context at the start, so
early blocks are accepted less), and a rate estimated from a handful of blocks is noisy; on the
embedded pair planners that followed their estimates lost to a fixed block of 4 on 6-7 of 8
prompts, while a wrong switch to speculation costs little there (docs/benchmarks.md, sessions
10-11). For the same reason the draft's own per-proposal confidence does not shorten a drafted
block: measured, verifying fewer proposals when it was low lost to verifying them all.

- Cold start: two plain steps (the second prices steady plain decoding), then the first drafted
  length is the incumbent: of 2 .. ``home_block`` (half the draft's trained block), the one whose
  verify pass is predicted to commit the most tokens per second under the prior acceptance. Too
  little is known then for the route prediction below, so a block of B is taken to fetch what
  the plain steps fetched times the union of B tokens' random routes (``distinct_experts``; an
  upper bound where routing has locality). On a link-bound target, where a block of 4 fetches
  about what 3.3 plain steps fetch, that is 2; where verify time hardly grows with B (the
  embedded pair on a CPU), half the trained block (docs/benchmarks.md, session 13). Where even
  that block is predicted to commit fewer tokens per second than plain decoding and shadow probes
  are possible (below), plain decoding stays the incumbent and the first look is a shadow probe;
  once its proposals are checked the same rule decides again, on the acceptance it measured.
  Otherwise the first block is verified: once drafting runs it stays unless plain decoding is
  predicted ``plain_margin`` ahead, so a block that pays a little keeps paying (measured: a
  shadow start that then needed ``switch_margin`` gave that up, docs/benchmarks.md, session 14).
- Acceptance per position: a Beta posterior mean over counts that decay by ``decay`` per verified
  block, so the estimate follows the text, shrunk toward the run's own long-run acceptance at that
  position (counts that decay more slowly, themselves shrunk toward ``prior_mean`` with weight
  ``long_run_weight``, 2), not toward a fixed prior mean (AcceptanceModel). With weight 4 at both
  levels one refused first block kept blocks of 4 under the switch margin through three shadow
  probes at P = 0.9 on an H200 (session 21).
- Costs come from the shared :class:`~pdflash.offload.cost.CostModel`: forward times per B
  (recent medians of measured verify and draft forwards, the step's own link time removed) and the
  link rate (the scheduler's counters). The experts a block will fetch are predicted from
  route-ahead's ``previous`` rule: the union of the experts of the last B committed positions, per
  layer, checked against the cache (resident, in flight, missing), plus a per-B correction
  measured as the EWMA of (experts actually fetched - experts predicted missing). An unmeasured B
  is priced at the nearest measured length's whole prediction times the ratio of their random
  unions (``_fetch``); so is a B last measured more than ``fresh_steps`` steps ago: its
  correction was learned against another history (the route of a block of 4 after blocks of 4
  reaches one step back, after blocks of 2 two steps, to experts evicted since), and next to
  today's route it counts the same experts twice.
- Two predictions of a block's fetch are kept side by side: that route-ahead one, and the recent
  mean of the experts B's own steps missed (an unmeasured B: the nearest measured length's, scaled
  by the ratio of random unions). Every step whose misses are measured adds each one's absolute
  error to an EWMA, and the one with the smaller recent error prices the blocks. On the
  gpt-oss-20b-shaped checkpoint (synthetic weights: consecutive tokens' routes share little) the
  route-ahead prediction erred by 15-35 experts a step where the mean erred by 11-16, in every
  GPU run of sessions 20-21; its swings moved the rate of blocks of 2 between 15 and 39 tokens/s
  from one step to the next. Where routes do repeat, the route-ahead one has the smaller error.
- A length verified fewer than ``settle`` times is priced at no more than ``outlier`` times what the
  other measured lengths interpolate to: one slow first block (another process on the machine)
  would otherwise price it alone, and once plain decoding leads, shadow probes refresh the
  acceptance but never that price (measured: a first block of 4 at 40 ms against 10 ms plain
  steps kept plain decoding for 61 of 62 steps on the embedded pair, docs/benchmarks.md, session 16).
- B = 1 is priced by what plain decoding measurably costs: the median of recent plain steps that
  followed a plain step (the first plain step after speculative ones pays for the cache the wider
  verify blocks left behind). Every ``remeasure_plain_every`` speculative steps in a row two plain
  steps keep that price current (plain steps get slower as the context grows), unless the recent
  drafted steps realize more than ``remeasure_unless`` times plain decoding's rate, when no
  plausible drift of that price could make plain decoding the choice.
- Floor: when the last ``floor_window`` drafted steps together committed fewer than ``floor`` times
  steady plain decoding's tokens per second, plain decoding becomes the incumbent whatever the
  predictions (a draft that does not fit the text), and stays so until a probe commits at least
  plain decoding's tokens per second.
- Retreat (``retreat`` = z): when the last ``floor_window`` blocks the incumbent length verified
  (probes left out) realize a rate whose ratio R to steady plain decoding's is below 1 with
  confidence, R + z SE(R) < 1 (SE from the spread of the blocks' committed tokens), plain decoding
  becomes the incumbent, without the floor's hold: the predictions decide from there. For a
  length that the margin keeps while it measurably loses (on the H200 at P = 0.3 a block of 2 kept
  its place for 17 steps at about 0.8x; docs/benchmarks.md, session 14). A fixed threshold (0.9)
  fired on the embedded pair where drafting paid, 16 blocks' ratio dipping by their spread alone;
  at z = 2 it fired in none of 24 runs there (session 16).
- Probes: while plain decoding is the incumbent, after ``probe_every`` plain steps the best
  speculative B runs once, so acceptance keeps being measured (the interval doubles, up to
  ``max_probe_interval``, while plain stays ahead, and falls to ``probe_after_accept`` (2) after
  a shadow probe whose every proposal was accepted: the draft fits the text again, and one refused
  block otherwise keeps a run plain, as a prompt at P = 0.9 on an H100 did for 46 steps, session
  17; not doubling while a speculative length is priced within 10 % of plain decoding was tried,
  session 21, and cost "def fibonacci(n):" 5 % on the embedded pair). Where speculation was left
  after at most ``short_look`` (2) verified blocks, the first probe comes after
  ``probe_after_accept`` plain steps: one refused block says little about the acceptance (at
  P = 0.9 on an H100 a prompt whose first block of 2 was refused ran 16 plain steps of 30 before
  two shadow probes brought blocks of 4 back, session 22; in the replay the first probe then
  comes 6 steps sooner and drafting resumes 5-42 steps sooner on 6 such seeds of 48); when the last committed tokens repeat an
  earlier stretch of the sequence, the probe comes early (at most every ``min_repeat_gap`` plain
  steps, a gap that doubles after each such probe whose proposals were all refused).
- Shadow probes: where the caller can compare proposals with what is committed (greedy decoding:
  ``plan_draft(..., can_shadow=True)``), a periodic probe drafts B positions (at least
  ``home_block``: one draft pass measures every position it drafts) but verifies only the
  step's own token, a plain step (:attr:`BlockPlanner.shadow_block`); the proposals
  (:meth:`BlockPlanner.shadow_proposals`) are then checked against the tokens the next steps
  commit, and their accepted prefix is recorded as a verified block's would be. It costs the
  draft's forward and no verify block: on a link-bound target a block of 2 fetches about 1.9 times
  a plain step's experts, which a probe at low acceptance pays for and a shadow probe does not.
  Probes on a repetition hint and while the floor holds plain decoding stay real: the first is
  likely to pay at once, the second must show a block that pays, not an acceptance.
- The hybrid placement (``placement``: the runtime guard's :attr:`~pdflash.offload.cpu_compute.HybridGuard.kept`):
  while the guard's first check still tries its arms, every step is plain (its arms' step times
  differ several-fold: a step of the "off" arm measured 4-12 ms against 1.2 ms for the kept one on
  the embedded pair on an H100, and blocks priced against plain steps of another arm kept blocks
  of 4 that ran at 0.89x plain decoding, docs/benchmarks.md, session 38; ``plain_while_placing``
  False plans them as any other, for an A/B: it cost "import os", where the draft is right, its
  first ~25 steps' speculation). When the guard keeps an
  arm (again), the measured step times of plain decoding and of the blocks' runs are dropped and the
  next steps start as the first ones do.
- Overdraft: where shadow checks are possible, a verified block of B drafts ``overdraft`` times B
  positions (up to ``max_block``, :attr:`BlockPlanner.draft_block`) and verifies B. When the whole
  block is accepted, the extra proposals (``end_step(..., tail=...)``) are checked against the
  tokens committed from its bonus token on, like a shadow probe's, and the block is recorded with
  every position it reached. Without it a run of short blocks never measures the positions past
  them, which keep the prior and hold a longer block under the switch margin (measured on an H100
  at P = 0.9: blocks of 2 for the whole run, docs/benchmarks.md, session 16). Twice the block,
  not a fixed 2 more: on the embedded pair blocks of 4 that drafted 6 left positions 6 and 7 at
  the prior and kept a block of 8 out where it paid ("import os": 2.34x against 2.64x,
  session 17). A length B is priced with the draft forward of the positions it drafts; with the
  draft's CUDA graphs a pass of 4 costs about what one of 2 does.
"""

from __future__ import annotations

import inspect
import json
import math
from collections import deque
from itertools import repeat
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdflash.offload.cost import CostModel, Ewma, RecentMedian, interpolate


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
    """Measured acceptance per draft position.

    Position i (1-based) has ``reached[i]`` (blocks in which positions 1 .. i-1 were accepted and
    i was drafted) and ``accepted[i]``, both multiplied by ``decay`` before each block is added
    (recent blocks weigh more); its conditional acceptance is the Beta posterior mean
    (accepted + w m_i) / (reached + w), with w = ``prior_weight``.

    The prior mean m_i is the run's own long-run acceptance at position i: the same posterior over
    counts that decay by ``slow_decay`` (1: never), with prior mean ``prior_mean``. A fixed prior
    mean next to counts that decay keeps its share for ever: weight 4 next to at most
    1 / (1 - decay) = 10 blocks held a measured 0.9 near 0.81, and a planner on an H100 at
    P = 0.9 kept blocks of 2 where blocks of 4 and 8 paid more (docs/benchmarks.md, session 19).
    A position rarely reached keeps an estimate near ``prior_mean``: taking it to accept like the
    one before it (tried) moved the embedded pair to blocks of 8 where 4 paid more.
    ``slow_decay`` None keeps the fixed prior mean.
    """

    def __init__(self, positions: int, prior_mean: float = 0.5, prior_weight: float = 1.0, decay: float = 1.0,
                 slow_decay: float | None = None, slow_weight: float | None = None):
        for name, d in (("decay", decay), ("slow_decay", 1.0 if slow_decay is None else slow_decay)):
            if not 0.0 < d <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {d}")
        self.positions = positions
        self.prior_mean = prior_mean
        self.prior_weight = prior_weight
        self.slow_weight = prior_weight if slow_weight is None else slow_weight
        self.decay = decay
        self.slow_decay = slow_decay
        self.reached = [0.0] * positions
        self.accepted = [0.0] * positions
        self.slow_reached = [0.0] * positions
        self.slow_accepted = [0.0] * positions
        self.records = 0  # blocks recorded so far

    def _posterior(self, accepted: list[float], reached: list[float], means: list[float], w: float) -> list[float]:
        return [(a + w * m) / (r + w) for a, r, m in zip(accepted, reached, means)]

    def prior_means(self) -> list[float]:
        """m_i: ``prior_mean`` everywhere, or the long-run estimates (see the class docstring)."""
        fixed = [self.prior_mean] * self.positions
        if self.slow_decay is None:
            return fixed
        return self._posterior(self.slow_accepted, self.slow_reached, fixed, self.slow_weight)

    def conditional(self) -> list[float]:
        return self._posterior(self.accepted, self.reached, self.prior_means(), self.prior_weight)

    def record(self, drafted: int, accepted: int) -> None:
        """A block verified ``drafted`` proposals and accepted the first ``accepted``."""
        self.records += 1
        if self.decay < 1.0:
            self.reached = [r * self.decay for r in self.reached]
            self.accepted = [a * self.decay for a in self.accepted]
        if self.slow_decay is not None and self.slow_decay < 1.0:
            self.slow_reached = [r * self.slow_decay for r in self.slow_reached]
            self.slow_accepted = [a * self.slow_decay for a in self.slow_accepted]
        for i in range(min(drafted, accepted + 1, self.positions)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted
            self.slow_reached[i] += 1
            self.slow_accepted[i] += i < accepted


@dataclass
class Choice:
    """One stage's decision: the block length, and what the planner expected of it."""

    block: int
    expected_tokens: float
    predicted_seconds: float | None
    fetch_experts: float  # experts' worth of link time predicted for the block (by the predictor in use)
    route_missing: float  # the route-ahead set's missing / in-flight experts
    fetch_route: float = 0.0  # the route-ahead prediction (route_missing plus B's measured correction)
    fetch_mean: float | None = None  # the recent-mean prediction (what B's own steps fetched), None before any


@dataclass
class PlannerReport:
    histogram: dict[int, int] = field(default_factory=dict)  # chosen B -> steps
    probes: int = 0  # drafts run only to keep measuring acceptance
    shadow_probes: int = 0  # of those, drafted and checked against later committed tokens, not verified
    overdrafted: int = 0  # verified blocks that drafted positions past the block (overdraft)
    retreats: int = 0  # times a speculative incumbent that measurably lost handed over to plain decoding
    trials: int = 0  # lengths run for trial_blocks blocks against the speculative incumbent's realized rate
    trials_kept: int = 0  # of those, the ones that realized more and stayed
    placing_steps: int = 0  # plain steps run while the hybrid placement was being chosen
    placement_restarts: int = 0  # times another kept placement dropped the measured step times
    predicted_seconds: float = 0.0  # summed over steps that had a prediction
    measured_seconds: float = 0.0  # the same steps, measured
    predicted_steps: int = 0
    abs_error_seconds: float = 0.0
    fetched_experts: float = 0.0
    host_experts: int = 0  # misses computed on the host instead (hybrid execution)
    committed_tokens: int = 0
    clock: str = "wall"  # what step times are measured in ("process_time": CPU seconds of the process)

    def to_dict(self) -> dict:
        n = self.predicted_steps
        return {
            "block_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "probes": self.probes,
            "shadow_probes": self.shadow_probes,
            "overdrafted_blocks": self.overdrafted,
            "retreats": self.retreats,
            "trials": self.trials,
            "trials_kept": self.trials_kept,
            "placing_steps": self.placing_steps,
            "placement_restarts": self.placement_restarts,
            "predicted_step_ms": 1e3 * self.predicted_seconds / n if n else None,
            "measured_step_ms": 1e3 * self.measured_seconds / n if n else None,
            "step_time_abs_error_ms": 1e3 * self.abs_error_seconds / n if n else None,
            "predicted_steps": n,
            "step_clock": self.clock,
            "fetched_experts_per_committed_token": self.fetched_experts / self.committed_tokens
            if self.committed_tokens else None,
            "host_experts_per_committed_token": self.host_experts / self.committed_tokens
            if self.committed_tokens else None,
        }


class BlockPlanner:
    """See the module docstring.

    ``cache`` (an ExpertCache, or None without offloading) answers resident / in flight;
    ``link_counters`` (bytes, busy seconds) feeds the cost model's link rate and measures each
    step's fetched experts; None without a scheduler. ``host_counter`` (experts computed on the
    host so far; hybrid execution) measures each step's misses that the host served instead: a
    step's misses are those fetched plus those, each priced as the cost model's placement serves
    it. ``clock`` (e.g. ``time.process_time``) makes the planner time the steps itself; without it
    (what generate does) the caller's wall-clock step times are used. ``trace`` keeps a record per
    step (``to_dict()["trace"]``: the block, the incumbent, its prediction against its measurement,
    the experts predicted against those missed, every length's predicted rate as decided).
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
        host_counter: Callable[[], int] | None = None,
        home_block: int | None = None,
        first_by_cost: bool = True,
        shadow_probes: bool = True,
        overdraft: float = 2.0,
        switch_margin: float = 1.15,
        spec_margin: float | None = None,
        trial_margin: float | None = 1.05,
        trial_blocks: int = 4,
        trial_cooldown: int = 32,
        trial_from_plain: bool = True,
        fetch_prediction: str = "best",
        long_run_weight: float = 2.0,
        plain_margin: float = 1.3,
        floor: float = 0.7,
        floor_window: int = 16,
        retreat: float | None = 2.0,
        settle: int = 3,
        outlier: float = 1.5,
        probe_every: int = 8,
        probe_after_accept: int | None = 2,
        short_look: int = 2,
        max_probe_interval: int = 64,
        min_repeat_gap: int = 4,
        remeasure_plain_every: int = 24,
        remeasure_unless: float | None = 1.5,
        fresh_steps: int | None = 8,
        recheck_below: float | None = 1.0,
        recheck_every: int = 4,
        placement: Callable[[], int | None] | None = None,
        plain_while_placing: bool = True,
        acceptance: AcceptanceModel | None = None,
        clock: Callable[[], float] | None = None,
        trace: bool = False,
    ):
        if max_block < 1:
            raise ValueError(f"max_block must be at least 1, got {max_block}")
        self.max_block = max_block
        self.home_block = min(max_block, max(2, (max_block + 1) // 2)) if home_block is None else home_block
        if not 1 <= self.home_block <= max_block:
            raise ValueError(f"home_block must be in 1 .. {max_block}, got {self.home_block}")
        self.first_by_cost = first_by_cost  # False: the first drafted block is home_block itself
        self.shadow_probes = shadow_probes  # False: every probe verifies its block
        self.shadow_block = 0  # this step's shadow probe: positions to draft and not verify (0: none)
        self._shadow: list[int] = []  # a shadow probe's proposals, checked against committed tokens
        self._shadow_accepted = 0  # how many of them the committed tokens matched so far
        self._first_look = False  # the cold start's shadow probe is being checked
        if not overdraft >= 1.0:
            raise ValueError(f"overdraft must be >= 1 (1: draft only the verified block), got {overdraft}")
        self.overdraft = overdraft  # a verified block of B drafts overdraft * B positions (up to max_block)
        self.draft_block = 0  # this step's draft: positions to draft (0: none)
        self._can_shadow = False  # this step's caller can check proposals against committed tokens
        self._tails: list[list] = []  # open overdraft checks: [proposals, matched, accepted in the block]
        self.cost = cost
        self.cache = cache
        self.link_counters = link_counters
        self.host_counter = host_counter
        self._step_host0 = 0
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.switch_margin, self.plain_margin = switch_margin, plain_margin
        self.spec_margin = switch_margin if spec_margin is None else spec_margin  # between two speculative lengths
        self.trial_margin, self.trial_blocks, self.trial_cooldown = trial_margin, trial_blocks, trial_cooldown
        self.trial_from_plain = trial_from_plain
        if fetch_prediction not in ("best", "route", "mean"):
            raise ValueError(f"fetch_prediction must be best, route or mean, got {fetch_prediction!r}")
        self.fetch_prediction = fetch_prediction
        # a running trial: (its length, the incumbent before it, that one's realized rate)
        self._trial: tuple[int, int, float] | None = None
        self._no_trial_until: dict[int, int] = {}  # B -> the step before which B is not tried again
        self.floor = floor
        self.retreat = retreat  # None: no retreat
        self.settle, self.outlier = settle, outlier
        self._verified: dict[int, int] = {}  # B -> verify forwards of B measured in this run
        self.clock = clock  # None: the step times the caller passes; else the planner times steps itself
        self._t0 = 0.0
        self.probe_every = probe_every
        self.probe_after_accept = probe_every if probe_after_accept is None else probe_after_accept
        self.max_probe_interval = max_probe_interval
        self.min_repeat_gap = min_repeat_gap
        self._repeat_gap = min_repeat_gap  # doubles after each repeat probe that accepted nothing
        self._repeat_probe = False
        self._probe_interval = probe_every  # doubles after each probe that leaves plain decoding ahead
        self.short_look = short_look  # speculation left after at most this many verified blocks: probe soon
        self._spec_blocks = 0  # blocks verified since plain decoding was last the incumbent
        self.remeasure_plain_every = remeasure_plain_every
        self.remeasure_unless = remeasure_unless
        self.acceptance = acceptance or AcceptanceModel(max(1, max_block - 1), prior_mean=0.6, prior_weight=4.0, decay=0.9,
                                                       slow_decay=0.98, slow_weight=long_run_weight)
        self._incumbent: int | None = None  # the block length being run (None during the cold start)
        self._spec_run = 0  # speculative steps in a row
        self._plain_run = 0  # plain steps in a row since the last drafted one (a shadow probe counts as drafted)
        self._history: deque[tuple[int, int, set[tuple[int, int]]]] = deque(maxlen=max_block)  # (committed, routed, (layer, expert)s) per step
        self._current: set[tuple[int, int]] = set()
        self._extra: dict[int, Ewma] = {}  # B -> EWMA(fetched - predicted missing)
        self._measured_at: dict[int, int] = {}  # B -> the step that last measured it (its correction and mean)
        self._missed_by: dict[int, Ewma] = {}  # B -> EWMA of the experts its steps missed
        self._err_route = Ewma(cost.alpha)  # recent absolute error of the route-ahead prediction, experts
        self._err_mean = Ewma(cost.alpha)  # the same, of the recent-mean prediction
        self.fresh_steps = fresh_steps  # a correction older than this many steps is not used (None: all are)
        self._steps = 0
        self._plain_steady = RecentMedian()  # measured plain steps that followed a plain step
        self._plain_fetched = Ewma(cost.alpha)  # experts fetched per plain step
        self._prev_block: int | None = None
        self._forced_plain = 0  # plain steps still to run for a re-measurement
        self._window: deque[tuple[int, float]] = deque(maxlen=floor_window)  # (committed, seconds) of drafted steps
        self._run: deque[tuple[int, float]] = deque(maxlen=floor_window)  # the same, of the incumbent's blocks since it began
        self._hold_plain = False  # the floor put plain decoding in: it stays until a probe pays
        # Plain decoding ahead: when the fastest drafted length was predicted below recheck_below
        # times plain decoding's rate, the next recheck_every - 1 plain steps price B = 1 alone (no
        # new acceptance came in meanwhile: any recorded block prices every length again). A plain
        # step's own bookkeeping is then what it costs (None: every step prices every length). At
        # 1.0 (below plain decoding's own rate; a switch needs the trial margin, 1.05, or more) the
        # replay's rates move by at most 0.01 tok/s against 0.7; on the embedded pair on an H100 a
        # plain step's planner work is a sixth of the step (docs/benchmarks.md, session 38).
        if recheck_below is not None and not 0.0 < recheck_below <= 1.0:
            raise ValueError(f"recheck_below must be in (0, 1] or None, got {recheck_below}")
        if recheck_every < 1:
            raise ValueError(f"recheck_every must be at least 1, got {recheck_every}")
        self.recheck_below, self.recheck_every = recheck_below, recheck_every
        self._recheck_at = 0  # the first step that prices every length again
        # The hybrid placement (see the module docstring): None while it is being chosen, then the
        # count of choices made; a new count restarts the step-time measurements.
        self.placement = placement
        self._placement_seen: int | None = None
        self._placing = False  # this step runs while the placement is being chosen: plain
        self.plain_while_placing = plain_while_placing  # False: the steps of the first check are planned as any
        self.variant: dict = {}  # keyword arguments a benchmark set through PDFLASH_PLANNER (make_planner)
        self._drafting = False  # stage 1 of the step running now ran the draft
        self._step_bytes0 = 0.0
        self._stage: Choice | None = None
        self._probe = False
        self._draft_clock = 0.0
        self.last_measured_seconds: float | None = None  # the last step, in the planner's clock
        self.trace: list[dict] | None = [] if trace else None  # per step, see end_step (to_dict()["trace"])
        self._rates: list[float | None] = []  # the last decision's predicted rate of B = 1 ..
        self.report = PlannerReport(clock="wall" if clock is None else getattr(clock, "__name__", "custom"))

    # -- inputs ----------------------------------------------------------------------
    def on_routed(self, layer: int, experts: Sequence[int]) -> None:
        """A target layer routed to ``experts`` (the runtime's routing observer): collected for
        the step running now, which :meth:`end_step` files with the tokens it committed."""
        self._current.update(zip(repeat(int(layer)), experts))

    def _bytes_now(self) -> tuple[float, float] | None:
        return self.link_counters() if self.link_counters is not None else None

    # -- predictions -------------------------------------------------------------------
    def _route_missing(self, limit: int) -> list[float]:
        """Route-ahead's ``previous`` rule for B = 1 .. ``limit`` in one pass: the experts of the
        latest B committed tokens, as experts' worth of link time still to come (missing, or in
        flight at ``in_flight_weight``) against the cache now; index B - 1. A step's experts are
        the union over the tokens its forward routed (its block, committed or not); where B needs
        ``k`` of a step's tokens, that step adds its share u(k) / u(routed) of what it adds whole
        (u: the random union, ``distinct_experts``). Whole, a block of 4 behind the latest step
        priced the next block of 2 with the experts of 4 tokens (on an H100: 250-390 predicted for
        150-230 fetched)."""
        out: list[float] = []
        seen: set[tuple[int, int]] = set()  # (layer, expert) counted
        resident, arriving = self.cache.held()
        in_flight = missing = covered = 0
        before = 0.0  # the value of the steps before the one being added
        for tokens, routed, experts in reversed(self._history):
            new = experts - seen  # set operations: a step of the 20b shape routes ~100 experts
            seen |= new
            coming = len(new & arriving)
            in_flight += coming
            missing += len(new) - coming - len(new & resident)
            value = self.cost.fetch_equivalents(in_flight, missing)
            whole = distinct_experts(routed, self.num_experts, self.top_k)
            while len(out) < min(covered + tokens, limit):
                k = len(out) + 1 - covered  # of this step's tokens, the ones B = len(out) + 1 needs
                share = 1.0 if k >= routed else distinct_experts(k, self.num_experts, self.top_k) / whole
                out.append(before + (value - before) * share)
            covered += tokens
            before = value
            if len(out) >= limit:
                break
        value = self.cost.fetch_equivalents(in_flight, missing)
        return out + [value] * (limit - len(out))

    def _fresh(self, by_block: dict[int, Ewma]) -> dict[int, float]:
        """B -> the value of a per-B measurement, of the lengths measured in the last
        ``fresh_steps`` steps (all of them if none was)."""
        known = {b: e.value for b, e in by_block.items() if e.value is not None}
        if self.fresh_steps is None:
            return known
        fresh = {b: v for b, v in known.items() if self._steps - self._measured_at.get(b, self._steps) < self.fresh_steps}
        return fresh or known

    def _known_extra(self) -> dict[int, float]:
        """B -> measured correction (experts fetched beyond the route-ahead set's missing ones)."""
        return self._fresh(self._extra)

    def _from_nearest(self, block: int, per_block: dict[int, float]) -> float:
        """An unmeasured B's fetch: the nearest measured length's (``per_block``, not empty; the
        shorter on a tie) scaled by the ratio of their random unions."""
        near = min(per_block, key=lambda b: (abs(b - block), b))
        return per_block[near] * distinct_experts(block, self.num_experts, self.top_k) / distinct_experts(
            near, self.num_experts, self.top_k)

    def _fetch_mean(self, block: int, means: dict[int, float]) -> float | None:
        """The recent-mean prediction: what B's own recent steps fetched (``means``), or for an
        unmeasured B the nearest measured length's scaled (``_from_nearest``); None before any
        step was measured."""
        if block in means:
            return means[block]
        return self._from_nearest(block, means) if means else None

    def _use_mean(self) -> bool:
        """Whether the recent-mean prediction prices the blocks: ``fetch_prediction`` "mean", or
        "best" and it has had the smaller recent error (see the module docstring)."""
        if self.fetch_prediction != "best":
            return self.fetch_prediction == "mean"
        route, mean = self._err_route.value, self._err_mean.value
        return route is not None and mean is not None and mean < route

    def _fetch(self, block: int, route: Sequence[float], known: dict[int, float]) -> float:
        """Experts' worth of link time a block of ``block`` tokens is predicted to fetch: its
        route-ahead set's missing experts (``route``, index B - 1) plus the measured correction of
        B; for an unmeasured B, the nearest measured length's whole prediction (its route plus its
        correction) scaled by the ratio of random unions. Not B's route plus the nearer length's
        scaled correction: a block of 2 whose last step's experts were still resident learned a
        correction of about its whole fetch, and a block of 4's route, reaching further back to
        experts evicted since, added them a second time (a replay of the H100 run of session 19
        priced blocks of 4 at 1.3-1.6x their fetch and kept blocks of 2)."""
        if block in known:
            return max(0.0, route[block - 1] + known[block])
        if known:
            return self._from_nearest(block, {b: max(0.0, route[b - 1] + v) for b, v in known.items()})
        u = distinct_experts(block, self.num_experts, self.top_k)
        share = min(1.0, self.cache.capacity / float(self.num_layers * self.num_experts))
        return max(0.0, route[block - 1] + self.num_layers * u * (1.0 - share))

    def _verify_seconds(self, block: int, fetch: float) -> float | None:
        """Predicted verify step of ``block`` tokens fetching ``fetch`` experts' worth: the cost
        model's, its forward capped at ``outlier`` times the other lengths' interpolation while
        ``block`` has fewer than ``settle`` measurements (see the module docstring)."""
        t = self.cost.step_seconds("verify", block, fetch)
        if t is None or self._verified.get(block, 0) >= self.settle:
            return t
        measured = self.cost.measured_forward("verify")
        own = measured.pop(block, None)
        others = interpolate(measured, block)
        if own is None or others is None:
            return t
        return t - max(0.0, own - self.outlier * others)

    def fetch_experts(self, block: int) -> tuple[float, float]:
        """(predicted missing of the route-ahead set, total experts' worth of link time) for B."""
        if self.cache is None:
            return 0.0, 0.0
        c = self._candidate(block)
        return c.route_missing, c.fetch_experts

    def drafted_for(self, block: int, can_shadow: bool | None = None) -> int:
        """Positions a verified block of ``block`` drafts: ``overdraft`` times as many (up to
        max_block) where the caller checks proposals against committed tokens."""
        shadow = self._can_shadow if can_shadow is None else can_shadow
        if block < 2 or not shadow or not self.shadow_probes:
            return block
        return min(self.max_block, max(block, math.ceil(self.overdraft * block - 1e-9)))

    def _candidates(self, low: int, limit: int) -> list[Choice]:
        """Choices for B = low .. limit with the acceptance expected now and the predicted step
        times (B = 1: steady plain decoding once measured; B > 1: draft + verify + fetches)."""
        probs = self.acceptance.conditional() if limit > 1 else []  # B = 1 commits its one token
        known = self._known_extra()
        # an unmeasured B is priced from the measured lengths' routes: look back as far as the longest
        # of them; lengths that are all measured need only their own (the route's first values do not
        # depend on how far it looks back), so pricing B = 1 alone walks just the latest step
        back = limit if all(b in known for b in range(low, limit + 1)) else max([limit, *known])
        route = self._route_missing(back) if self.cache is not None else [0.0] * limit
        means = self._fresh(self._missed_by)
        use_mean = self._use_mean()
        out = []
        for block in range(low, limit + 1):
            route_missing = route[block - 1]
            by_route = self._fetch(block, route, known) if self.cache is not None else 0.0
            by_mean = self._fetch_mean(block, means) if self.cache is not None else None
            fetch = by_mean if use_mean and by_mean is not None else by_route
            if block == 1 and self._plain_steady.value is not None:
                t = self._plain_steady.value  # measured, fetches included
            else:
                t = self._verify_seconds(block, fetch)
                if t is not None and block > 1:
                    draft = self.cost.forward_seconds("draft", self.drafted_for(block))
                    t = None if draft is None else draft + t
            out.append(Choice(block, expected_committed(probs, block), t, fetch, route_missing, by_route, by_mean))
        return out

    def _candidate(self, block: int) -> Choice:
        return self._candidates(block, block)[0]

    @staticmethod
    def _rate(c: Choice) -> float | None:
        return None if not c.predicted_seconds else c.expected_tokens / c.predicted_seconds

    def _fastest(self, cands: Sequence[Choice]) -> Choice | None:
        """The candidate with the highest predicted rate (the shorter on a tie), None if none is predicted."""
        rated = [c for c in cands if self._rate(c) is not None]
        return max(rated, key=lambda c: (self._rate(c), -c.block)) if rated else None

    def _decide(self, limit: int) -> Choice:
        """The incumbent, or the best predicted B if it beats the incumbent by the margin."""
        inc = min(self._incumbent or self.home_block, limit)
        cands = self._candidates(1, limit)
        current = cands[inc - 1]
        if self.trace is not None:
            self._rates = [self._rate(c) for c in cands]
        if self._trial is not None:  # a trial (the incumbent now) runs its blocks; end_step judges it
            return current
        best = self._fastest(cands)
        if best is None or self._rate(current) is None:
            return current
        if current.block == 1 and self.recheck_below is not None:
            spec = self._fastest(cands[1:])
            far = spec is None or self._rate(spec) < self.recheck_below * self._rate(current)
            self._recheck_at = self._steps + self.recheck_every if far else 0
        if best.block == 1:
            margin = self.plain_margin
        else:
            margin = self.switch_margin if current.block == 1 else self.spec_margin
        if self._rate(best) > margin * self._rate(current):
            return best
        from_plain = current.block == 1 and self.trial_from_plain
        if (self.trial_margin is not None and best.block > 1 and best.block != current.block
                and (current.block > 1 or from_plain)
                and self._rate(best) > self.trial_margin * self._rate(current)
                and self._steps >= self._no_trial_until.get(best.block, 0)
                and (from_plain or len(self._run) >= self.trial_blocks)):
            base = self._plain_rate() if from_plain else self._run_rate()  # what the trial's blocks must beat
            if base is not None:
                self._trial = (best.block, current.block, base)
                self.report.trials += 1
                return best
        return current

    def _plain_rate(self) -> float | None:
        """Tokens per second of steady plain decoding (None before it is measured)."""
        plain = self._plain_steady.value
        return 1.0 / plain if plain else None

    def _run_rate(self) -> float | None:
        """Tokens per second the incumbent's own recent blocks realized (None before any time)."""
        seconds = sum(t for _, t in self._run)
        return sum(c for c, _ in self._run) / seconds if seconds > 0 else None

    def _below_floor(self) -> bool:
        """The last ``floor_window`` drafted steps together committed fewer than ``floor`` times
        steady plain decoding's tokens per second."""
        if len(self._window) < (self._window.maxlen or 0):
            return False
        ratio = self._realized_ratio()
        return ratio is not None and ratio < self.floor

    def _realized_ratio(self) -> float | None:
        """Tokens per second of the recent drafted steps (the floor's window) over steady plain
        decoding's; None before both are measured."""
        plain = self._plain_steady.value
        seconds = sum(t for _, t in self._window)
        if not plain or not self._window or seconds <= 0:
            return None
        return sum(c for c, _ in self._window) / seconds * plain

    def _losing(self) -> bool:
        """The incumbent's last ``floor_window`` verified blocks realize under plain decoding's rate
        with confidence: R + z SE(R) < 1, R their tokens per second over steady plain decoding's,
        SE(R) the ratio estimator's standard error from the blocks' spread, z = ``retreat``."""
        n = len(self._run)
        plain = self._plain_steady.value
        if self.retreat is None or n < max(2, self._run.maxlen or 0) or not plain:
            return False
        tokens = sum(c for c, _ in self._run)
        seconds = sum(t for _, t in self._run)
        if seconds <= 0:
            return False
        rate = tokens / seconds
        spread = sum((c - rate * t) ** 2 for c, t in self._run) / (n - 1)
        se = plain * (spread / n) ** 0.5 / (seconds / n)
        return rate * plain + self.retreat * se < 1.0

    def _clearly_ahead(self) -> bool:
        """The recent drafted steps realize more than ``remeasure_unless`` times plain decoding's
        rate: plain decoding would have to have become that much faster than measured, relative to
        the drafted steps, to be chosen (at the 30 % margin, 15 % for 1.5), so the periodic
        re-measurement is skipped (it costs two plain steps where drafting pays most)."""
        ratio = self._realized_ratio()
        return self.remeasure_unless is not None and ratio is not None and ratio > self.remeasure_unless

    def _first_block(self, limit: int) -> tuple[int, bool]:
        """The first drafted length (see the module's docstring): by expected tokens per predicted
        verify second, the draft's time left out (it is not measured before the first block); and
        whether that rate is predicted at least plain decoding's (True when nothing is predicted)."""
        top = min(self.home_block, limit)
        plain_fetch = self._plain_fetched.value
        if plain_fetch is None or not self.first_by_cost:
            return top, True
        probs = self.acceptance.conditional()
        one = distinct_experts(1, self.num_experts, self.top_k)
        best, best_rate = top, None
        for block in range(2, top + 1):
            fetch = plain_fetch * distinct_experts(block, self.num_experts, self.top_k) / one
            verify = self._verify_seconds(block, fetch)
            rate = expected_committed(probs, block) / verify if verify else None
            if rate is not None and (best_rate is None or rate > best_rate):
                best, best_rate = block, rate
        plain = self._plain_steady.value
        return best, best_rate is None or not plain or best_rate * plain >= 1.0

    def _best_speculative(self, limit: int) -> Choice:
        return self._fastest(self._candidates(2, limit)) or self._candidate(min(self.home_block, limit))

    # -- the step ------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.placement is not None:
            kept = self.placement()
            self._placing = kept is None and self.plain_while_placing
            if kept is not None and kept != self._placement_seen:
                if self._placement_seen is not None or self._steps:
                    self._restart_times()
                self._placement_seen = kept
        self._current = set()
        self._draft_clock = 0.0
        if self.clock is not None:
            self._t0 = self.clock()
        c = self._bytes_now()
        self._step_bytes0 = c[0] if c is not None else 0.0
        self._step_host0 = self.host_counter() if self.host_counter is not None else 0

    def _restart_times(self) -> None:
        """Another hybrid placement runs from now on: the step times measured under the earlier
        ones (plain decoding's, the drafted steps' realized rates, a trial's base) are dropped and
        the next steps start as a run's first ones do (plain until measured, then the cold start's
        choice). Acceptance, fetch corrections and the cost model's estimates stay."""
        self._plain_steady = RecentMedian()
        self._prev_block = None  # the next plain step follows a step of another placement: not steady
        self._window.clear()
        self._run.clear()
        self._trial = None
        self._hold_plain = False
        self._first_look = False
        self._incumbent = None
        self._recheck_at = 0
        self.report.placement_restarts += 1

    def plan_draft(self, limit: int, repeating: bool = False, can_shadow: bool = False) -> int:
        """The block length to draft and verify now (<= ``limit`` <= max_block), or 1 for a
        plain step. ``repeating``: the last committed tokens already occurred earlier in the
        sequence (text that copies itself is where a draft is most often right); during a plain
        stretch it brings the next probe forward (at most every ``min_repeat_gap`` plain steps,
        doubling after each such probe that accepted nothing). ``can_shadow``: the caller passes
        the committed tokens to :meth:`end_step` and a plain step may draft
        :attr:`shadow_block` positions (greedy decoding), see the module's docstring."""
        self._new_stage(can_shadow)
        if self._plain_unpriced(limit):
            best = self._plain_unpriced_choice()
        else:
            shadow_first = 0
            if self._incumbent is None:
                first, ahead = self._first_block(limit)
                if not ahead and can_shadow and self.shadow_probes:
                    shadow_first = first  # predicted behind plain decoding: look before drafting for real
                    self._first_look = True
                self._set_incumbent(1 if shadow_first else first)
            elif self._first_look and not self._shadow:
                self._first_look = False  # the first look is checked: decide as the cold start does, on what it saw
                first, ahead = self._first_block(limit)
                if ahead:
                    self._set_incumbent(first)
            if self._incumbent > 1 and self._below_floor():
                self._set_incumbent(1)  # held until a probe pays
                self._hold_plain = True
                self._window.clear()
            elif self._incumbent > 1 and self._losing():
                self._set_incumbent(1)  # no hold: the predictions decide from here
                self.report.retreats += 1
            if self._hold_plain or (self._incumbent == 1 and self._trial is None and self._steps < self._recheck_at):
                best = self._candidate(1)
            else:
                best = self._decide(limit)
            if best.block != min(self._incumbent, limit):
                self._set_incumbent(best.block)
            shadow = can_shadow and self.shadow_probes and not self._hold_plain
            if best.block == 1 and shadow_first:
                self.report.probes += 1
                self.report.shadow_probes += 1
                self.shadow_block = max(shadow_first, min(self.home_block, limit))
            elif best.block == 1 and self._plain_run + 1 >= self._probe_interval and not (shadow and self._shadow):
                self.report.probes += 1  # (a shadow probe still being checked delays the next one)
                self._probe_interval = min(self.max_probe_interval, 2 * self._probe_interval)
                spec = self._best_speculative(limit)
                if shadow:
                    self.report.shadow_probes += 1
                    self.shadow_block = max(spec.block, min(self.home_block, limit))  # drafted, then a plain step
                else:
                    self._probe = True
                    best = spec
            elif best.block == 1 and repeating and self._plain_run + 1 >= self._repeat_gap:
                self.report.probes += 1  # the text repeats itself: look now, the interval unchanged
                self._probe = self._repeat_probe = True
                best = self._best_speculative(limit)
            elif best.block > 1 and self._spec_run + 1 >= self.remeasure_plain_every and not self._clearly_ahead():
                self.report.probes += 1  # two plain steps keep B = 1's steady time measured
                self._forced_plain = 1
                best = self._candidate(1)
        self._stage = best
        if best.block == 1:
            self._plain_run = 0 if self.shadow_block else self._plain_run + 1  # a probe ends the plain run
            self._spec_run = 0
            self.draft_block = self.shadow_block
            return 1
        if self._incumbent and self._incumbent > 1:
            self._probe_interval = self.probe_every  # speculation is the incumbent: probe at the base rate later
        self._plain_run = 0
        self._spec_run += 1
        self._drafting = True
        self.draft_block = min(limit, self.drafted_for(best.block))  # no proposals past the last token
        return best.block

    def _new_stage(self, can_shadow: bool) -> None:
        """A step is being planned: nothing chosen, drafted or probed yet."""
        self._stage = None
        self._rates = []
        self._probe = self._repeat_probe = self._drafting = False
        self.shadow_block = 0
        self.draft_block = 0
        self._can_shadow = can_shadow

    def _plain_unpriced(self, limit: int) -> bool:
        """The step is plain whatever the other lengths would price at: one token left, a
        re-measurement, the guard's first check, or the cold start (plain decoding unmeasured)."""
        return (limit <= 1 or self._forced_plain > 0 or self._placing or self._plain_steady.value is None
                or 1 not in self.cost.measured_forward("verify"))

    def _plain_unpriced_choice(self) -> Choice:
        self._forced_plain = max(0, self._forced_plain - 1)  # a re-measurement, or the cold start
        self.report.placing_steps += self._placing
        return self._candidate(1)

    def decide_plain(self, limit: int, repeating: bool = False) -> bool:
        """Decide the next step plain, and return True, where :meth:`plan_draft` would choose a
        plain step without pricing any other length and without a probe: the cold start's, a
        re-measurement's or the guard's first check's plain steps, a plain incumbent between two
        rechecks, plain decoding held by the floor; with no shadow probe or overdraft still being
        checked and the hybrid placement unchanged. Otherwise False, and nothing changes. After
        True the caller runs the step as plain decoding runs (nothing drafted) and files it with
        :meth:`end_step`, in place of begin_step and plan_draft: on the embedded pair on an H100
        those and the loop's work around them took 0.5 ms of a 1.6 ms plain step (session 40). B =
        1 is priced as plan_draft prices it, so every decision stays the same. ``limit`` and
        ``repeating`` as for :meth:`plan_draft`."""
        if self.placement is not None:
            kept = self.placement()
            if (kept is None and self.plain_while_placing) != self._placing or (
                    kept is not None and kept != self._placement_seen):
                return False  # begin_step files the change
        if self._shadow or self._tails:
            return False  # their checks may record acceptance, after which every length is priced
        unpriced = self._plain_unpriced(limit)
        if not unpriced:
            if self._incumbent != 1 or self._trial is not None or self._first_look:
                return False
            if not self._hold_plain and self._steps >= self._recheck_at:
                return False  # every length is priced again
            if self._plain_run + 1 >= self._probe_interval:
                return False  # a probe is due
            if repeating and self._plain_run + 1 >= self._repeat_gap:
                return False  # the text repeats itself: a probe
        # begin_step's part: the step's counters and clock start where the last step ended (end_step)
        self._current = set()
        self._draft_clock = 0.0
        self._new_stage(self._can_shadow)
        self._stage = self._plain_unpriced_choice() if unpriced else self._candidate(1)
        self._plain_run += 1
        self._spec_run = 0
        return True

    def _set_incumbent(self, block: int) -> None:
        """Run ``block`` from now on; a new incumbent's own blocks are counted afresh (retreat); a
        trial of another length ends unjudged."""
        if block != self._incumbent:
            self._run.clear()
        if self._trial is not None and block != self._trial[0]:
            self._trial = None
        if block == 1 and self._incumbent is not None and self._incumbent > 1:
            if 1 <= self._spec_blocks <= self.short_look:  # left on a look too short to know the acceptance
                self._probe_interval = min(self._probe_interval, self.probe_after_accept)
            self._spec_blocks = 0
        self._incumbent = block

    def _judge_trial(self) -> None:
        """After its blocks, a trial's length stays the incumbent if they realized more tokens per
        second than the incumbent it replaced did; otherwise that one runs again and the length is
        not tried for ``trial_cooldown`` steps."""
        block, prev, base = self._trial
        rate = self._run_rate()  # the trial's own blocks: the run was cleared when it began
        self._trial = None
        if rate is not None and rate > base:
            self.report.trials_kept += 1
        else:
            self._no_trial_until[block] = self._steps + 1 + self.trial_cooldown  # (this step not yet counted)
            self._set_incumbent(prev)

    def shadow_proposals(self, proposals: Sequence[int]) -> None:
        """The shadow probe's proposals (this step's ``shadow_block - 1``), to be checked against
        the tokens committed from this step on."""
        self._shadow = [int(t) for t in proposals]
        self._shadow_accepted = 0

    @staticmethod
    def _match(proposals: Sequence[int], matched: int, tokens: Sequence[int]) -> tuple[int, bool]:
        """Committed ``tokens`` against ``proposals`` from ``matched`` on: the proposals matched
        now, and whether the check is over (a token differed or every proposal matched)."""
        for t in tokens:
            if int(t) != proposals[matched]:
                return matched, True
            matched += 1
            if matched == len(proposals):
                return matched, True
        return matched, False

    def _check_shadow(self, tokens: Sequence[int]) -> None:
        """Committed ``tokens`` against the shadow probe's proposals still open; its accepted
        prefix is recorded once a token differs or every proposal matched."""
        self._shadow_accepted, done = self._match(self._shadow, self._shadow_accepted, tokens)
        if not done:
            return  # every token matched and proposals remain: the next steps decide
        self.acceptance.record(len(self._shadow), self._shadow_accepted)
        if self._shadow_accepted == len(self._shadow):
            self._probe_interval = self.probe_after_accept  # all accepted: look again soon
        self._shadow = []

    def _check_tails(self, tokens: Sequence[int], checks: list[list] | None = None) -> None:
        """Committed ``tokens`` against the open overdraft checks (or ``checks``, new ones); a
        finished check records its block with every position it reached."""
        still = []
        for check in self._tails if checks is None else checks:
            proposals, matched, base = check
            check[1], done = self._match(proposals, matched, tokens)
            if done:
                self.acceptance.record(base + len(proposals), base + check[1])
            else:
                still.append(check)  # every token matched and proposals remain: the next steps decide
        self._tails = still if checks is None else self._tails + still

    def after_draft(self, drafted: int, draft_seconds: float) -> None:
        """The draft of ``drafted`` positions took ``draft_seconds`` (the planner's own clock
        replaces it when it has one)."""
        if self.clock is not None:
            draft_seconds = self.clock() - self._t0
            self._draft_clock = draft_seconds
        self.cost.observe_forward("draft", drafted, draft_seconds)

    def current(self) -> Choice | None:
        """The choice the step is running."""
        return self._stage

    def end_step(self, block: int, accepted: int, committed: int, seconds: float, draft_seconds: float = 0.0,
                 tokens: Sequence[int] = (), tail: Sequence[int] = ()) -> None:
        """The step verified ``block`` tokens, accepted ``accepted`` proposals, committed
        ``committed`` tokens (``tokens``, what a shadow probe's proposals are checked against) and
        took ``seconds`` (draft + verify; with a ``clock`` the planner's own measurements replace
        ``seconds`` and ``draft_seconds``). ``tail``: the proposals drafted past the block
        (overdraft), checked from the block's bonus token (``tokens[accepted]``) on."""
        if self.clock is not None:
            seconds = self.clock() - self._t0
            draft_seconds = self._draft_clock
        records = self.acceptance.records
        self.last_measured_seconds = seconds
        if self._drafting or block > 1:  # the step ran the draft
            self._window.append((committed, seconds))
            plain = self._plain_steady.value
            if self._probe and self._hold_plain and seconds > 0 and (not plain or committed / seconds >= 1.0 / plain):
                self._hold_plain = False  # a probe that paid: the predictions decide again
        if block > 1 and not self._probe:
            self._spec_blocks += 1
        if block > 1 and not self._probe and block == self._incumbent:  # a block of the incumbent's own
            self._run.append((committed, seconds))
            if self._trial is not None and len(self._run) >= self.trial_blocks:
                self._judge_trial()
        # a plain step after a plain step (a shadow probe's step also ran the draft)
        steady = not self._drafting and not self.shadow_block and block == 1 and self._prev_block == 1
        if steady:
            self._plain_steady.add(seconds)
        self._prev_block = block
        counters = self._bytes_now()
        fetched = 0.0
        host_now = self.host_counter() if self.host_counter is not None else 0
        host = max(0, host_now - self._step_host0)
        self._step_host0 = host_now  # where a step decide_plain decides (no begin_step) starts
        if counters is not None:
            fetched = max(0.0, counters[0] - self._step_bytes0) / self.cost.expert_bytes
            self._step_bytes0 = counters[0]
            self.cost.observe_link(*counters)
        missed = fetched + host  # the step's misses, whichever pipe served them
        if counters is not None and steady:
            self._plain_fetched.add(missed)
        choice = self._stage if self._stage is not None and self._stage.block == block else None
        self.cost.observe_forward("verify", block, max(0.0, seconds - draft_seconds), fetched, host)
        self._verified[block] = self._verified.get(block, 0) + 1
        if self.cache is not None:
            pred_missing = choice.route_missing if choice is not None else 0.0
            self._extra.setdefault(block, Ewma(self.cost.alpha)).add(missed - pred_missing)
            self._measured_at[block] = self._steps
            if counters is not None or self.host_counter is not None:  # the misses were measured
                self._missed_by.setdefault(block, Ewma(self.cost.alpha)).add(missed)
            if choice is not None and choice.fetch_mean is not None:
                self._err_route.add(abs(choice.fetch_route - missed))
                self._err_mean.add(abs(choice.fetch_mean - missed))
        self._steps += 1
        if self._tails and tokens:
            self._check_tails(tokens)
        if block > 1 and tail:
            self.report.overdrafted += 1
        if block > 1 and tail and accepted == block - 1 and len(tokens) > accepted:
            self._check_tails(tokens[accepted:], [[[int(t) for t in tail], 0, accepted]])  # recorded once checked
        elif block > 1:
            self.acceptance.record(block - 1, accepted)
        if self._shadow and tokens:
            self._check_shadow(tokens)
        if self._repeat_probe:  # repetition that the draft did not follow: trust the hint less
            self._repeat_gap = self.min_repeat_gap if accepted else min(64, 2 * self._repeat_gap)
        if self.acceptance.records != records:
            self._recheck_at = 0  # new acceptance: every length is priced again
        self._history.append((committed, block, self._current))
        self._current = set()
        if self.trace is not None:
            self.trace.append({
                "block": block, "incumbent": self._incumbent, "accepted": accepted, "committed": committed,
                "probe": self._probe or bool(self.shadow_block),
                "predicted_ms": None if choice is None or choice.predicted_seconds is None
                else round(1e3 * choice.predicted_seconds, 2),
                "measured_ms": round(1e3 * seconds, 2),
                "predicted_fetch": None if choice is None else round(choice.fetch_experts, 1),
                "fetch_route": None if choice is None else round(choice.fetch_route, 1),
                "fetch_mean": None if choice is None or choice.fetch_mean is None else round(choice.fetch_mean, 1),
                "missed": round(missed, 1),
                "rates": [None if r is None else round(r, 2) for r in self._rates],  # tokens/s of B = 1 .. as decided
            })
        if self.clock is not None:
            self._t0 = self.clock()  # where a step decide_plain decides starts
        r = self.report
        r.histogram[block] = r.histogram.get(block, 0) + 1
        r.fetched_experts += fetched
        r.host_experts += host
        r.committed_tokens += committed
        if choice is not None and choice.predicted_seconds is not None:
            r.predicted_steps += 1
            r.predicted_seconds += choice.predicted_seconds
            r.measured_seconds += seconds
            r.abs_error_seconds += abs(choice.predicted_seconds - seconds)

    def to_dict(self) -> dict:
        plain = self._plain_steady.value
        return {**self.report.to_dict(), "acceptance_conditional": self.acceptance.conditional(),
                # what the planner prices plain decoding at (recent steady plain steps), and the
                # realized rate of its recent drafted steps against it (the floor's and retreat's view)
                "plain_step_ms": None if plain is None else 1e3 * plain,
                "realized_vs_plain": self._realized_ratio(),
                "home_block": self.home_block, "cost": self.cost.to_dict(),
                **({"variant": self.variant} if self.variant else {}),
                # which fetch prediction prices blocks now, and both recent absolute errors (experts per step)
                "fetch_prediction": {"mode": self.fetch_prediction, "in_use": "mean" if self._use_mean() else "route",
                                     "route_error": self._err_route.value, "mean_error": self._err_mean.value},
                # every length as the planner prices it now: what a run's choices are read against
                "candidates": {str(c.block): {
                    "expected_tokens": c.expected_tokens,
                    "predicted_ms": None if c.predicted_seconds is None else 1e3 * c.predicted_seconds,
                    "tokens_per_second": self._rate(c), "fetch_experts": c.fetch_experts,
                } for c in self._candidates(1, self.max_block)},
                **({"trace": self.trace} if self.trace is not None else {})}


def parse_variant(spec: str) -> tuple[str, dict]:
    """A planner variant for the benchmarks' A/B arms: 'NAME=JSON' -> (NAME, BlockPlanner keyword
    arguments). ValueError, with what is wrong, on a missing name, text that is not a JSON object,
    or a key that is not a keyword argument of BlockPlanner."""
    name, sep, text = spec.partition("=")
    if not name or not sep:
        raise ValueError(f"takes NAME=JSON, got {spec!r}")
    try:
        kw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not JSON ({exc})") from None
    if not isinstance(kw, dict):
        raise ValueError(f"{name}: a JSON object of BlockPlanner keyword arguments, got {text!r}")
    known = inspect.signature(BlockPlanner.__init__).parameters
    unknown = sorted(k for k in kw if k not in known or known[k].kind != inspect.Parameter.KEYWORD_ONLY)
    if unknown:
        raise ValueError(f"{name}: not BlockPlanner keyword arguments: {', '.join(unknown)}")
    return name, kw
