"""The runs of ``bench-priority``: one loaded target and draft (:class:`PriorityBench`), switched
between arms by non-terminal cache resets; the metrics of one run (:func:`sample_metrics`) and the
traced steps behind the link timeline (:func:`trace_steps`)."""

from __future__ import annotations

import sys
import time
from typing import Callable

from pdflash import PdflashError
from pdflash.bench.budget import Budget
from pdflash.bench.config import ARM_SPECS, BAND_NAMES, LEVEL_KEYS, ArmSpec, PriorityConfig, oracle_seed
from pdflash.native import Band


# -- one loaded model, every arm -----------------------------------------------------------------
class _DecodeWindow:
    """Snapshot the runtime's counters when the first target forward after the prompt starts.
    Installed for one run; it observes the runtime's forwards, eager or graphed (a module hook
    would miss the graphed decoder's replays). Prompts longer than one prefill chunk start
    several forwards, so the window opens at the first single-block forward after them."""

    def __init__(self, rt, prompt_tokens: int, max_block: int):
        self.rt = rt
        self.prompt_tokens = prompt_tokens
        self.max_block = max_block
        self.seen = 0  # tokens of the forwards so far
        self.start: dict | None = None
        self.t_start: float | None = None
        rt.add_forward_observer(self._on_forward)

    def _on_forward(self, tokens: int) -> None:
        if self.start is None and self.seen >= self.prompt_tokens and tokens <= self.max_block:
            self.start = counters(self.rt)
            self.t_start = time.monotonic()
        self.seen += tokens

    def close(self) -> None:
        self.rt.remove_forward_observer(self._on_forward)


def counters(rt) -> dict:
    """Cumulative counters of the cache (wait points) and the scheduler (bands 0-2) right now."""
    st = rt.stats()
    levels = rt.scheduler.stats()["levels"]
    return {
        "exposed": st["exposed_fetch_seconds"],
        "exposed_by_band": dict(st["exposed_fetch_by_band"] or {}),
        "waits_by_band": dict(st["waits_by_band"] or {}),
        "hits": st["cache"]["hits"],
        "misses": st["cache"]["misses"],
        "demand_fetches": st["demand_fetches"],
        "bytes": st["bytes_moved"],
        "link_busy_s": st["link_busy_seconds"],
        "levels": {BAND_NAMES[b]: {k: levels[b][k] for k in LEVEL_KEYS} for b in range(3)},
    }


def _delta(end, start):
    if isinstance(end, dict):
        return {k: _delta(v, (start or {}).get(k)) for k, v in end.items()}
    if end is None:
        return None
    return end - (start or 0)


def _replay_predictor(steps: list[dict[int, list[int]]]):
    """Route-ahead predictor of the oracle arm: step i predicts the experts verify pass i used
    (known before the draft runs, so submitted at the start of the step)."""
    from pdflash.draft.route_ahead import Predictor

    class ReplayPredictor(Predictor):
        name = "oracle-replay"

        def __init__(self):
            self.i = 0

        def before_draft(self):
            s = steps[self.i] if self.i < len(steps) else None
            self.i += 1
            return {layer: set(ex) for layer, ex in s.items()} if s else None

    return ReplayPredictor()


class PriorityBench:
    """The loaded runtime + draft and the runs of one benchmark. Use :func:`run_priority_bench`."""

    def __init__(self, cfg: PriorityConfig, budget: Budget, log: Callable[[str], None]):
        self.cfg, self.budget, self.log = cfg, budget, log
        self.rt = None
        self.draft = None
        self.switches = 0  # non-terminal reset_cache() calls between runs
        self.references: list[list[int] | None] = []
        self.oracle_plans: list[list[dict[int, list[int]]] | None] = []

    # -- setup ---------------------------------------------------------------------------------
    def load(self) -> None:
        from pdflash.draft.offloaded import load_runtime_draft
        from pdflash.offload.runtime import OffloadedModel

        cfg, b = self.cfg, self.budget
        t0 = time.perf_counter()
        self.rt = OffloadedModel.load(
            cfg.model_dir, device=cfg.device, dtype=cfg.dtype, expert_cache_experts=b.allocated_experts, block_tokens=b.block_size,
            link_gbps=cfg.link_gbps, workers=cfg.workers, lookahead_depth=0, history_depth=0,
            progress=sys.stderr.isatty(), trace=TRACE_EVENTS if cfg.timeline else 0,
        )
        self.draft = load_runtime_draft(self.rt, cfg.draft_dir)  # as generate loads it
        self.load_s = time.perf_counter() - t0
        tok = self.rt.tokenizer
        self.prompts = [list(tok.encode(t, add_special_tokens=False)) for t in cfg.prompt_texts()]
        if any(not p for p in self.prompts):
            raise PdflashError("a prompt encodes to no tokens: give non-empty prompts")

    def prepare(self) -> None:
        """Untimed per-prompt work: the greedy reference (oracle-acceptance mode) and the oracle
        arm's recorded verify experts."""
        from pdflash.draft.offloaded import oracle_reference, verify_decoder
        from pdflash.offload.prompt import check_context

        rt, cfg = self.rt, self.cfg
        for prompt in self.prompts:  # every prompt fits before any of them runs
            check_context(rt.config, len(prompt), cfg.max_new_tokens)
        for pi, prompt in enumerate(self.prompts):
            ref = None
            if cfg.draft_acceptance is not None:  # from the verify path's arithmetic (draft/oracle.py)
                self.configure("on-demand")
                decoder = verify_decoder(rt, self.draft, len(prompt) + cfg.max_new_tokens, cfg.draft_acceptance,
                                         at=len(prompt), blocks=range(1, self.budget.block_size + 1))
                ref = oracle_reference(rt, prompt, cfg.max_new_tokens, self.budget.block_size, decoder=decoder)
            self.references.append(ref)
            plan = None
            if "oracle" in cfg.arms:
                self.configure("on-demand")
                plan = []
                with rt.record_routing() as rec:
                    res = self._speculate(ARM_SPECS["on-demand"], pi, block_size=self.budget.block_size,
                                          on_step=lambda info: plan.append(dict(rec.forwards[-1])))
                if len(plan) != res.stats.verify_steps:
                    raise PdflashError(f"internal: recorded {len(plan)} verify passes for {res.stats.verify_steps} steps")
            self.oracle_plans.append(plan)

    # -- one run ---------------------------------------------------------------------------------
    def configure(self, arm: str) -> None:
        """Switch the runtime to ``arm``: non-terminal reset to an empty cache of the arm's
        capacity, prefetcher bands and depths; the resident arm then fills the cache."""
        spec, b, rt = ARM_SPECS[arm], self.budget, self.rt
        rt.reset_cache(capacity_experts=b.total_experts if spec.resident else b.budget_experts)
        self.switches += 1
        p = rt.prefetcher
        p.route_ahead_priority = spec.route_ahead_band if spec.route_ahead_band is not None else int(Band.ROUTE_AHEAD)
        p.background_priority = int(Band.BACKGROUND)
        p.lookahead_depth = 0
        p.history_depth = min(self.cfg.history_depth, b.num_layers) if spec.history else 0
        if spec.resident:
            landed = rt.preload(zero_stats=True)
            if landed != b.total_experts:
                raise PdflashError(f"internal: the resident arm holds {landed} of {b.total_experts} experts")

    def _speculate(self, spec: ArmSpec, pi: int, on_step=None, block_size=None):
        """One run of arm ``spec``; ``block_size`` overrides the configured one (the oracle arm's
        recording and replay use fixed full blocks: the planner's choices vary between runs)."""
        from pdflash.draft.offloaded import speculative_on_runtime

        cfg, rt = self.cfg, self.rt
        prompt, ref = self.prompts[pi], self.references[pi]
        if not spec.oracle:
            predictor = cfg.predictor if spec.route_ahead_band is not None else None
            block = block_size if block_size is not None else (cfg.block_size or self.budget.block_size)
            return speculative_on_runtime(
                rt, self.draft, prompt, cfg.max_new_tokens, block_size=block, predictor=predictor,
                acceptance=cfg.draft_acceptance, reference=ref, seed=oracle_seed(cfg.seed, pi), eos_token_ids=[],
                on_step=on_step,
            )
        return self._speculate_oracle(pi, on_step)

    def _speculate_oracle(self, pi: int, on_step):
        """The oracle arm: ``speculative_generate`` with the arguments ``speculative_on_runtime``
        gives it, the route-ahead predictor replaced by the recorded verify experts."""
        from pdflash.draft.offloaded import prepare_draft, verify_decoder
        from pdflash.draft.route_ahead import RouteAhead, window_for_cache
        from pdflash.draft.speculative import make_oracle, speculative_generate

        cfg, rt, b = self.cfg, self.rt, self.budget
        prompt = self.prompts[pi]
        oracle = None
        if cfg.draft_acceptance is not None:
            oracle = make_oracle(rt.model, prompt, cfg.max_new_tokens, cfg.draft_acceptance,
                                 reference=self.references[pi], eos_token_ids=[], seed=oracle_seed(cfg.seed, pi))
        ra = RouteAhead(rt.model, "previous", rt.prefetcher.prefetch_experts, block_size=b.block_size,
                        priority=rt.prefetcher.route_ahead_priority, bytes_per_expert=rt.cache.slot_bytes,
                        window_layers=window_for_cache(rt.cache.capacity, b.num_experts, b.top_k, b.block_size))
        ra.predictor = _replay_predictor(self.oracle_plans[pi])
        ra.report.predictor = ra.predictor.name
        # the verify path speculative_on_runtime takes (graphed on CUDA, fixed rows in bf16 oracle mode)
        decoder = verify_decoder(rt, self.draft, len(prompt) + cfg.max_new_tokens, cfg.draft_acceptance,
                                 at=len(prompt), blocks=sorted({1, b.block_size}))
        prepare_draft(rt, self.draft, decoder, len(prompt), cfg.max_new_tokens, [b.block_size])
        try:
            return speculative_generate(rt.model, self.draft, prompt, cfg.max_new_tokens, block_size=b.block_size,
                                        eos_token_ids=[], route_ahead=ra, oracle=oracle, on_step=on_step,
                                        decoder=decoder)
        finally:
            ra.close()

    def run_one(self, arm: str, pi: int, step_times: list | None = None) -> dict:
        """Switch to ``arm``, generate prompt ``pi``, return the sample (metrics of this run)."""
        self.configure(arm)
        rt = self.rt
        window = _DecodeWindow(rt, len(self.prompts[pi]), self.budget.block_size)
        on_step = (lambda info: step_times.append(time.monotonic())) if step_times is not None else None
        t0 = time.perf_counter()
        try:
            res = self._speculate(ARM_SPECS[arm], pi, on_step)
        finally:
            window.close()
        wall = time.perf_counter() - t0
        end = counters(rt)
        final = rt.stats()
        s = sample_metrics(res, window.start, end, final)
        ref = self.references[pi]
        s["same_tokens_as_reference"] = (res.token_ids == ref) if ref is not None else None
        s["wall_s"] = wall
        s["decode_window_start_monotonic"] = window.t_start
        return s


TRACE_EVENTS = 1 << 16  # transfers the scheduler remembers for the timeline


def trace_steps(bench: PriorityBench, arms: list[str], log: Callable[[str], None]) -> dict:
    """One extra run per arm with the scheduler's transfer trace on; keeps the transfers of one
    verify step in the middle of the run (times in seconds from the step's start).

    These runs are not samples: they only draw the link timeline.
    """
    sched = bench.rt.scheduler
    out: dict = {"available": True, "arms": {}}
    for arm in arms:
        sched.drain_trace()  # drop what earlier runs left
        times: list[float] = []
        s = bench.run_one(arm, 0, step_times=times)
        events = sched.drain_trace()
        if not times:
            continue
        k = len(times) // 2  # a step in the middle of the run
        w0 = times[k - 1] if k >= 1 else s["decode_window_start_monotonic"]
        w1 = times[k]
        rows = []
        for e in events:
            start, end = e.get("start_s"), e.get("end_s")
            if start is None or end is None or end < w0 or start > w1:
                continue
            rows.append({
                "band": int(e["priority"]), "layer": int(e["layer"]), "expert": int(e["expert"]),
                "status": str(e.get("status")), "nbytes": int(e.get("nbytes") or 0),
                "submit_s": e["submit_s"] - w0 if e.get("submit_s") is not None else None,
                "start_s": start - w0, "end_s": end - w0,
            })
        out["arms"][arm] = {"step": k + 1, "steps": len(times), "step_s": w1 - w0, "transfers": rows,
                            "prompt": 0, "events_in_run": len(events)}
        log(f"timeline: {arm} step {k + 1}/{len(times)}: {len(rows)} transfers in {1e3 * (w1 - w0):.1f} ms")
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def sample_metrics(res, start: dict | None, end: dict, final: dict) -> dict:
    """One run's metrics from its SpeculativeResult and the counters at the decode-window
    start / end (``start`` None: no decode forward ran, so decode-window metrics are None)."""
    st = res.stats
    n = len(res.token_ids)
    d = _delta(end, start) if start is not None else None
    exposed = None
    if d is not None and end["exposed"] is not None and start["exposed"] is not None:
        exposed = end["exposed"] - start["exposed"]
    by_band = waits = levels = None
    od_per_fetch = hits = misses = hit_rate = bytes_moved = link_busy = demand = None
    if d is not None:
        by_band = {name: d["exposed_by_band"].get(name, 0.0) if end["exposed"] is not None else None
                   for name in BAND_NAMES}
        waits = {name: d["waits_by_band"].get(name, 0) for name in BAND_NAMES}
        hits, misses, demand = d["hits"], d["misses"], d["demand_fetches"]
        hit_rate = _ratio(hits, hits + misses)
        bytes_moved, link_busy = d["bytes"], d["link_busy_s"]
        levels = d["levels"]
        if by_band["on-demand"] is not None and waits["on-demand"] > 0:
            od_per_fetch = by_band["on-demand"] / waits["on-demand"]
    ra = res.route_ahead
    oracle = res.oracle or {}
    return {
        "tokens": n,
        "verify_steps": st.verify_steps,
        "acceptance_length": st.acceptance_length if st.verify_steps else None,
        "tokens_per_second": res.tokens_per_second,
        "tpot_ms": 1e3 * st.decode_seconds / (n - 1) if n > 1 and st.decode_seconds > 0 else None,
        "prefill_ms": 1e3 * st.prefill_seconds,
        "exposed_fetch_s": exposed,
        "exposed_fetch_ms_per_step": 1e3 * exposed / st.verify_steps if exposed is not None and st.verify_steps else None,
        "exposed_fetch_total_s": final["exposed_fetch_seconds"],
        "exposed_fetch_prefill_s": start["exposed"] if start is not None else None,
        "exposed_fetch_by_band_s": by_band,
        "waits_by_band": waits,
        "on_demand_stall_per_fetch_s": od_per_fetch,
        "hits": hits,
        "misses": misses,
        "hit_rate": hit_rate,
        "demand_fetches": demand,
        "bytes_moved": bytes_moved,
        "bytes_moved_total": final["bytes_moved"],
        "link_busy_s": link_busy,
        "bands": levels,
        "prefetch": {k: final["prefetch"][k] for k in ("issued", "used", "wasted", "cancelled", "dropped", "redundant")},
        "route_ahead": None if ra is None else {k: ra[k] for k in ("predictor", "priority", "predicted", "used", "hits",
                                                                 "recall", "precision")},
        "oracle_divergences": oracle.get("oracle_divergences"),
        "oracle_refreshes": oracle.get("oracle_refreshes"),
        "block_histogram": st.block_histogram(),
        "bytes_per_committed_token": bytes_moved / st.committed_tokens if bytes_moved is not None and st.committed_tokens else None,
        "planner_predicted_step_ms": (res.planner or {}).get("predicted_step_ms"),
        "planner_measured_step_ms": (res.planner or {}).get("measured_step_ms"),
        "planner_abs_error_ms": (res.planner or {}).get("step_time_abs_error_ms"),
        "errors": list(final.get("errors") or []),
    }
