"""One cost model for the decisions the runtime makes per step: what a set of experts costs to
serve, and what a forward of B tokens costs.

Speculative decoding (``pdflash.draft.planner``) asks it how long a verify step of B tokens will
take given the experts the block is predicted to touch; hybrid execution (experts computed on the
host instead of fetched) asks it whether fetching or host compute serves an expert sooner. Both
read the same measured rates:

- link rate, bytes per second: from the scheduler's own counters (bytes moved over all bands and
  the seconds the link was busy), fed by :meth:`CostModel.observe_link` with cumulative values;
  the rate is the EWMA of the per-interval ratio. Prior: the simulated link (``--link-gbps``) when
  there is one, else :data:`LINK_PRIOR_BYTES_PER_S` for the device type.
- device compute per expert (seconds per expert for a forward of T tokens): fed by
  :meth:`observe_expert_compute`; no prior (None until measured).
- forward time per block length B, for each kind of forward ("verify", "draft", "plain"): median
  of the last 8 measured step times with each step's own link time removed (:meth:`observe_forward`), so a
  prediction for a different set of missing experts adds their link time back. Before B is
  measured, the nearest measured B stands in (batch-1 and small-batch forwards are bound by the
  same weight reads); before anything is measured the prediction is None.
- resident / in-flight experts: read from the :class:`~pdflash.offload.cache.ExpertCache` at the
  time of the question (:meth:`experts_to_fetch`). An expert already in flight costs
  ``in_flight_weight`` of a fetch (prior 0.5: on average half its bytes are still to come).
- host compute: the hook :attr:`CostModel.cpu_expert_seconds`, a callable ``(tokens) -> seconds
  per expert`` that hybrid execution installs once it has calibrated its host kernel
  (:meth:`set_cpu_expert_rate`). None means "no host path": :meth:`serve` then fetches everything
  and :meth:`step_seconds` prices every missing expert at its fetch time; with the hook set both
  take, per expert, the sooner of fetch and host compute (the block planner's predictions follow).

- per-layer placement (:meth:`CostModel.place_layer`, hybrid execution): for the experts a
  layer needs that are not resident, which to fetch and which to compute on the host so that
  the layer's critical path is shortest. The host side is the calibrated, kept-current rate of
  the native CPU kernel (``pdflash.offload.cpu_compute.CpuExpertRunner``, installed through
  :meth:`set_cpu_expert_rate`); the link side the measured link rate and what is in flight;
  the device side the measured device compute per expert (0 until measured); the host side pays
  once per layer the measured overhead of handing work to the host and its results back
  (:meth:`CostModel.observe_host_overhead`, 0 until measured).

Nothing here is a result: every prediction is a measured rate times a count, or a documented
prior until the first measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

LINK_PRIOR_BYTES_PER_S = {"cuda": 25e9, "cpu": 10e9}  # PCIe Gen4-5 x16 effective; host memcpy
EWMA_ALPHA = 0.2
FORWARD_KINDS = ("verify", "draft", "plain")


class RecentMedian:
    """Median of the last ``window`` samples: a step time that one slow step (a first call's
    allocations, another process on the machine) does not drag for many steps."""

    def __init__(self, window: int = 8):
        self.window = window
        self.samples: list[float] = []
        self.count = 0
        self._value: float | None = None

    def add(self, x: float) -> float:
        self.samples.append(float(x))
        del self.samples[: -self.window]
        self.count += 1
        s = sorted(self.samples)
        n = len(s)
        self._value = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
        return self._value

    @property
    def value(self) -> float | None:
        return self._value


class Ewma:
    """Exponentially weighted mean; the first sample sets it."""

    def __init__(self, alpha: float = EWMA_ALPHA):
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1
        return self.value


@dataclass
class ServePlan:
    """How a set of (layer, expert) pairs would be served: counts and predicted seconds."""

    resident: int = 0
    in_flight: int = 0
    to_fetch: int = 0
    host: int = 0  # computed on the host instead (hybrid execution; 0 without a host rate)
    fetch_seconds: float = 0.0
    host_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.fetch_seconds + self.host_seconds


@dataclass
class LayerPlacement:
    """One layer's choice: experts computed on the host, experts fetched, and the predicted
    finish of each side (seconds from the decision; the layer ends at the later one)."""

    host: list[int]
    fetch: list[int]
    host_seconds: float = 0.0
    device_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.host_seconds, self.device_seconds)


class CostModel:
    """See the module docstring. Not thread-safe; one per runtime."""

    def __init__(
        self,
        expert_bytes: int,
        *,
        device_type: str = "cuda",
        link_gbps: float | None = None,
        alpha: float = EWMA_ALPHA,
        in_flight_weight: float = 0.5,
    ):
        if expert_bytes <= 0:
            raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
        self.expert_bytes = int(expert_bytes)
        self.alpha = alpha
        self.in_flight_weight = float(in_flight_weight)
        self.link_prior = link_gbps * 1e9 if link_gbps else LINK_PRIOR_BYTES_PER_S.get(device_type, 10e9)
        self._link = Ewma(alpha)
        self._last_link: tuple[float, float] | None = None  # cumulative (bytes, busy seconds)
        self._forward: dict[str, dict[int, RecentMedian]] = {k: {} for k in FORWARD_KINDS}
        # kind -> token count -> estimate, in token order: read by every prediction (a planner prices
        # 8 block lengths a step), rebuilt only after observe_forward changed that kind
        self._forward_known: dict[str, dict[int, float]] = {}
        self._expert_compute: dict[int, Ewma] = {}  # tokens -> device seconds per expert
        self.cpu_expert_seconds: Callable[[int], float | None] | None = None  # hybrid execution's hook
        self.placement: Callable[[int], str] | None = None  # tokens -> the arm serving such a forward's misses
        self.host_layer_overhead = Ewma(alpha)  # seconds a layer's host share costs beyond the kernel

    @classmethod
    def for_runtime(cls, rt, **kwargs) -> "CostModel":
        """A model for an ``OffloadedModel``: its expert size, device type and simulated link."""
        return cls(rt.host.layout.expert_bytes, device_type=rt.device.type, link_gbps=rt.link_gbps, **kwargs)

    # -- measurements ------------------------------------------------------------------
    def observe_link(self, total_bytes: float, busy_seconds: float) -> float | None:
        """Cumulative bytes moved and link-busy seconds (the scheduler's counters); the rate of
        the interval since the last call enters the EWMA. A counter that went backwards (a reset)
        restarts the interval. Returns the interval's rate, or None when it moved nothing."""
        last = self._last_link
        self._last_link = (float(total_bytes), float(busy_seconds))
        if last is None or total_bytes < last[0] or busy_seconds < last[1]:
            return None
        db, ds = total_bytes - last[0], busy_seconds - last[1]
        if db <= 0 or ds <= 0:
            return None
        rate = db / ds
        self._link.add(rate)
        return rate

    def observe_scheduler(self, scheduler_stats: dict) -> float | None:
        """:meth:`observe_link` from ``Scheduler.stats()`` (all bands' bytes, ``link_busy_s``)."""
        total = sum(lv["bytes"] for lv in scheduler_stats["levels"])
        return self.observe_link(total, scheduler_stats["link_busy_s"])

    def observe_forward(self, kind: str, tokens: int, seconds: float, fetched_experts: float = 0.0,
                        host_experts: float = 0.0) -> None:
        """A forward of ``kind`` over ``tokens`` tokens took ``seconds``, fetched ``fetched_experts``
        experts over the link and computed ``host_experts`` on the host; its time without serving
        them is recorded (the two pipes overlap under the "model" placement, else they add up)."""
        if kind not in FORWARD_KINDS:
            raise ValueError(f"unknown forward kind {kind!r}; one of {FORWARD_KINDS}")
        link = fetched_experts * self.seconds_per_expert_fetch()
        host = host_experts * (self.host_expert_seconds(tokens) or 0.0) if host_experts else 0.0
        served = max(link, host) if self.placement_of(tokens) == "model" else link + host
        self._forward[kind].setdefault(int(tokens), RecentMedian()).add(max(0.0, seconds - served))
        self._forward_known.pop(kind, None)

    def observe_expert_compute(self, tokens: int, experts: int, seconds: float) -> None:
        """Device compute of ``experts`` experts over ``tokens`` tokens took ``seconds``."""
        if experts > 0:
            self._expert_compute.setdefault(int(tokens), Ewma(self.alpha)).add(seconds / experts)

    def set_cpu_expert_rate(self, fn: Callable[[int], float | None] | None,
                            placement: Callable[[int], str] | None = None) -> None:
        """Hybrid execution's hook: ``fn(tokens)`` = calibrated host seconds to compute one expert
        over ``tokens`` tokens (None: not measured yet). None removes the host path.
        ``placement(tokens)``: how a forward of that many tokens serves its misses now (the hybrid
        guard's arm: "off", "model", "host" or "all"); without it, "model"."""
        self.cpu_expert_seconds = fn
        self.placement = placement if fn is not None else None

    def host_expert_seconds(self, tokens: int) -> float | None:
        """The host kernel's seconds for one expert over ``tokens`` tokens (None: no host path, or
        not measured yet)."""
        return self.cpu_expert_seconds(tokens) if self.cpu_expert_seconds is not None else None

    def placement_of(self, tokens: int) -> str:
        """The placement serving a forward of ``tokens`` tokens' misses ("off" without a host path)."""
        if self.cpu_expert_seconds is None:
            return "off"
        return self.placement(tokens) if self.placement is not None else "model"

    def observe_host_overhead(self, seconds: float) -> None:
        """One layer's host share took ``seconds`` beyond its kernel time: the hand-off to the
        computing thread, the rows to the host and the results back (hybrid execution)."""
        if seconds >= 0:
            self.host_layer_overhead.add(seconds)

    # -- rates -------------------------------------------------------------------------
    @property
    def link_bytes_per_s(self) -> float:
        """Measured link rate (EWMA), or the prior before the first measurement."""
        return self._link.value if self._link.value else self.link_prior

    @property
    def link_measured(self) -> bool:
        return self._link.value is not None

    def seconds_per_expert_fetch(self) -> float:
        return self.expert_bytes / self.link_bytes_per_s

    def device_expert_seconds(self, tokens: int) -> float | None:
        """Device seconds per expert for ``tokens`` tokens (nearest measured token count), or None."""
        return _estimate(self._expert_compute, tokens)

    def forward_seconds(self, kind: str, tokens: int) -> float | None:
        """Predicted time of a ``kind`` forward of ``tokens`` tokens with nothing to fetch: its
        recent median; before it is measured, interpolated between measured token counts (or the nearest),
        None before any."""
        return interpolate(self._known_forward(kind), tokens)

    def _known_forward(self, kind: str) -> dict[int, float]:
        known = self._forward_known.get(kind)
        if known is None:
            known = self._forward_known[kind] = {
                t: e.value for t, e in sorted(self._forward[kind].items()) if e.value is not None}
        return known

    def measured_forward(self, kind: str) -> dict[int, float]:
        """Token count -> current estimate of each measured ``kind`` forward (a copy)."""
        return dict(self._known_forward(kind))

    # -- predictions -------------------------------------------------------------------
    def experts_to_fetch(self, experts: Iterable[tuple[int, int]], cache) -> tuple[int, int, int]:
        """(resident, in flight, missing) counts of the distinct pairs against ``cache`` now."""
        resident = in_flight = missing = 0
        for layer, e in set(experts):
            state = cache.state_of(layer, e)
            if state == "resident":
                resident += 1
            elif state == "arriving":
                in_flight += 1
            else:
                missing += 1
        return resident, in_flight, missing

    def fetch_equivalents(self, in_flight: int, missing: int) -> float:
        """Experts' worth of link time still to come for these counts."""
        return missing + self.in_flight_weight * in_flight

    def serve(self, experts: Iterable[tuple[int, int]], cache, tokens: int = 1) -> ServePlan:
        """How the pairs would be served now: resident ones are free; missing ones are fetched,
        or computed on the host when the hybrid hook says that is sooner than the link."""
        resident, in_flight, missing = self.experts_to_fetch(experts, cache)
        plan = ServePlan(resident=resident, in_flight=in_flight)
        fetch_one = self.seconds_per_expert_fetch()
        host_one = self.host_expert_seconds(tokens)
        if host_one is not None and host_one < fetch_one:
            plan.host = missing
            plan.host_seconds = missing * host_one
        else:
            plan.to_fetch = missing
        plan.fetch_seconds = self.fetch_equivalents(in_flight, plan.to_fetch) * fetch_one
        return plan

    def place_layer(self, missing: dict[int, int], in_flight: int = 0, resident_tokens: Iterable[int] = ()) -> LayerPlacement:
        """Split one layer's non-resident experts between the link and the host.

        ``missing``: expert -> tokens routed to it, for experts neither resident nor on the way;
        ``in_flight``: experts of this layer already crossing the link (they stay there);
        ``resident_tokens``: tokens of each resident expert (the device computes those first).

        Device side: the link delivers the in-flight experts (``in_flight_weight`` of a fetch
        each) and then the fetched ones back to back; the device computes the resident experts
        meanwhile and each fetched one after it lands, so it finishes at
        max(resident compute, last arrival) + one expert's compute. Host side: the kernel runs
        its experts one after another (all its threads on each) while the device works. The
        experts cheapest on the host go there first; the split with the earliest finish of the
        later side wins (fewest host experts on a tie). The host side also pays, once, its measured
        per-layer overhead (:meth:`observe_host_overhead`). Without a host rate everything is fetched.
        """
        order = sorted(missing, key=lambda e: (missing[e], e))
        fetch_one = self.seconds_per_expert_fetch()
        dev = lambda t: self.device_expert_seconds(t) or 0.0  # noqa: E731
        resident_s = sum(dev(t) for t in resident_tokens)
        backlog = self.in_flight_weight * in_flight * fetch_one
        host_fn = self.cpu_expert_seconds

        def device_finish(fetched: list[int]) -> float:
            if not fetched and not in_flight:
                return resident_s
            arrive = backlog + len(fetched) * fetch_one
            last = dev(missing[fetched[-1]]) if fetched else dev(1)
            return max(resident_s + sum(dev(missing[e]) for e in fetched[:-1]), arrive) + last

        best = LayerPlacement([], list(order), 0.0, device_finish(list(order)))
        if host_fn is None or not order:
            return best
        host_s = self.host_layer_overhead.value or 0.0  # any host share pays it once
        for k in range(1, len(order) + 1):
            one = host_fn(missing[order[k - 1]])
            if one is None:
                break
            host_s += one
            fetched = order[k:]
            cand = LayerPlacement(order[:k], fetched, host_s, device_finish(fetched))
            if cand.seconds < best.seconds:
                best = cand
        return best

    def ahead_layer(self, missing: float, precision: float, tokens: int, gap_s: float, most: int) -> tuple[int, float | None]:
        """Route-ahead in a split host step (host_graph.py): each layer's host node prefetches m
        of the next layer's predicted experts, ``precision`` of which that layer then needs.
        With ``missing`` non-resident experts a layer (each over ``tokens`` tokens), the host
        computes the ``missing - precision * m`` not prefetched, one after another; the link
        moves the m prefetches while the previous layer's host work and the ``gap_s`` between
        two layers run, so a layer waits for them only by what m fetches take beyond that:
        a layer takes max(host seconds, m * fetch - gap_s). Returns (m in 0 .. most, the layer's
        seconds) with the fewest seconds, the smaller m on a tie; (0, None) without a host rate."""
        host = self.host_expert_seconds(max(1, tokens))
        if host is None:
            return 0, None
        fetch = self.seconds_per_expert_fetch()
        overhead = self.host_layer_overhead.value or 0.0
        best: tuple[int, float] | None = None
        for m in range(max(0, most) + 1):
            left = max(0.0, missing - precision * m)
            host_s = left * host + (overhead if left > 0 else 0.0)
            seconds = max(host_s, m * fetch - gap_s)
            if best is None or seconds < best[1]:
                best = (m, seconds)
        return best

    def serve_seconds(self, experts: Iterable[tuple[int, int]], cache, tokens: int = 1) -> float:
        return self.serve(experts, cache, tokens).seconds

    def seconds_per_missing_expert(self, tokens: int) -> float:
        """What one expert that is not resident costs a forward of ``tokens`` tokens, by the
        placement serving it (:meth:`placement_of`): its fetch ("off"); its host compute ("host",
        "all": the host serves every miss); the two pipes side by side ("model": fetch and host
        rates add up). Its fetch while the host rate is unmeasured."""
        fetch_one = self.seconds_per_expert_fetch()
        arm = self.placement_of(tokens)
        host_one = self.host_expert_seconds(tokens) if arm != "off" else None
        if not host_one:
            return fetch_one
        if arm == "model":
            return fetch_one * host_one / (fetch_one + host_one)
        return host_one

    def step_seconds(self, kind: str, tokens: int, fetch_experts: float) -> float | None:
        """Predicted time of a ``kind`` forward of ``tokens`` tokens whose missing experts are
        ``fetch_experts`` experts' worth (each served as :meth:`seconds_per_missing_expert`
        says); None before any such forward is measured."""
        base = self.forward_seconds(kind, tokens)
        if base is None:
            return None
        return base + fetch_experts * self.seconds_per_missing_expert(tokens)

    def to_dict(self) -> dict:
        return {
            "link_bytes_per_s": self.link_bytes_per_s,
            "link_measured": self.link_measured,
            "expert_bytes": self.expert_bytes,
            "forward_ms": {k: {t: v * 1e3 for t, v in self.measured_forward(k).items()} for k in FORWARD_KINDS},
            "device_expert_ms": {t: e.value * 1e3 for t, e in sorted(self._expert_compute.items())},
            "host_path": self.cpu_expert_seconds is not None,
            "host_expert_ms": _ms(self.host_expert_seconds(1)),
            "placement": self.placement_of(1),  # how a decode step's misses are served now
            "host_layer_overhead_ms": _ms(self.host_layer_overhead.value),
            "fetch_expert_ms": self.seconds_per_expert_fetch() * 1e3,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _estimate(table: dict, tokens: int) -> float | None:
    """The estimate of ``table`` (token count -> Ewma / RecentMedian) at ``tokens``: :func:`interpolate`."""
    return interpolate({t: e.value for t, e in table.items() if e.value is not None}, tokens)


def interpolate(known: dict[int, float], tokens: int) -> float | None:
    """The value at ``tokens`` of measured ``known`` (token count -> value); unmeasured: linear
    between the measured neighbours on both sides, else the nearest measured one; None when
    nothing is measured."""
    if not known:
        return None
    if tokens in known:
        return known[tokens]
    lower = [t for t in known if t < tokens]
    upper = [t for t in known if t > tokens]
    if lower and upper:
        lo, hi = max(lower), min(upper)
        return known[lo] + (known[hi] - known[lo]) * (tokens - lo) / (hi - lo)
    return known[max(lower) if lower else min(upper)]
