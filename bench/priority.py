"""``bench-priority``: the route-ahead band ablation and its ship / no-ship decision.

One process loads the target once (:class:`~pdflash.offload.runtime.OffloadedModel`) and the
DFlash draft once, then runs every arm on it. Between runs only the non-terminal
``rt.reset_cache(capacity_experts=...)`` is called; ``rt.close()`` runs once, after the last arm.

Arms (``ARM_SPECS``):

- ``flat``      route-ahead prefetches at BACKGROUND (2), history prefetch at 2: one prefetch band.
- ``banded``    route-ahead prefetches at ROUTE_AHEAD (1), history prefetch at BACKGROUND (2).
- ``on-demand`` no prefetch at all (no route-ahead, lookahead or history): every miss waits.
- ``resident``  every expert resident before the run (cache capacity = all experts): the lower
                bound on step time; its exposed fetch must read ~0.
- ``oracle``    ``banded`` with the route-ahead prediction replaced by the experts each verify pass
                really used, recorded in an untimed run of the same prompt (routing is deterministic
                under greedy decoding with a fixed oracle seed) and replayed before each step's draft.
                It bounds what a better predictor could gain.

The budget arms share one expert-cache budget (a fraction of all experts, or MiB); the device
slot tensor is allocated once, for all experts when ``resident`` runs, and the budget is a
capacity limit on it.

Method. Every arm starts from an empty cache (``resident``: from a full one). Arm order is shuffled
per repetition with ``random.Random(order_seed(seed, rep))``; ``warmup`` rounds of every arm are
run first and discarded. Each (repetition, prompt) pair runs every arm: these are the pairs of
the paired statistics. Decoding is speculative (``speculative_on_runtime``, the library loop that
``pdflash generate --draft`` uses; the oracle arm calls the same ``speculative_generate`` with a
replaying predictor), greedy, EOS ignored, so every run yields exactly ``max_new_tokens`` tokens;
with ``draft_acceptance`` P the proposals come from oracle-acceptance mode with a seed fixed per
prompt, so every arm and repetition does the same work.

Metric windows. The decode window opens when the first target forward after the prefill starts
and closes when generation returns; the prefill (a cold cache filling on demand, the same in every
arm) is reported apart. Exposed fetch is the time the forward pass spent blocked at the cache's
wait points (``rt.stats()``), split by the band the awaited expert was first requested at;
per-band stall and queue wait come from the native scheduler. A metric that was not measured is
``None``, never 0.
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from pdflash import Interrupted, PdflashError
from pdflash.bench import stats as bstats
from pdflash.machine import machine_info
from pdflash.native import Band

ARMS = ("flat", "banded", "on-demand", "resident", "oracle")
BAND_NAMES = ("on-demand", "route-ahead", "background")  # Band 0, 1, 2
DEFAULT_PROMPTS = (
    "The router scores all experts and keeps the best four",
    "Questions and answers: what is the capital of France?",
    "def route(hidden, router, top_k=4):",
    "Write a short story about a lighthouse keeper who",
    "The expert cache keeps the most useful experts on the device and",
    "Explain why the link between host memory and the GPU limits decoding speed:",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a city built on a river,",
)
SCHEMA = "pdflash.bench-priority/1"
VERDICTS = ("ship", "no-ship", "inconclusive", "unmeasurable")
LEVEL_KEYS = ("submitted", "completed", "cancelled", "promoted", "deduplicated", "bytes",
              "queue_wait_s", "stall_s", "stall_waits", "transfer_s")


@dataclass(frozen=True)
class ArmSpec:
    """How one arm sets up the runtime. ``route_ahead_band`` None: no route-ahead at all."""

    name: str
    route_ahead_band: int | None
    history: bool
    resident: bool = False
    oracle: bool = False
    description: str = ""


ARM_SPECS = {
    "flat": ArmSpec("flat", int(Band.BACKGROUND), True,
                    description="route-ahead prefetch at band 2 (background), history prefetch at band 2"),
    "banded": ArmSpec("banded", int(Band.ROUTE_AHEAD), True,
                      description="route-ahead prefetch at band 1 (route-ahead), history prefetch at band 2"),
    "on-demand": ArmSpec("on-demand", None, False, description="no prefetch of any kind; every miss waits at band 0"),
    "resident": ArmSpec("resident", None, False, resident=True,
                        description="every expert resident before the run (cache holds all experts); no prefetch"),
    "oracle": ArmSpec("oracle", int(Band.ROUTE_AHEAD), True, oracle=True,
                      description="banded, with route-ahead predicting exactly the experts each verify pass used "
                                  "(recorded in an untimed run of the same prompt, replayed before each draft)"),
}


def order_seed(seed: int, rep: int) -> int:
    """Seed of the arm order of repetition ``rep`` (recorded in the output)."""
    return seed * 1_000_003 + rep


def oracle_seed(seed: int, prompt_index: int) -> int:
    """Seed of oracle-acceptance proposals for one prompt: the same in every arm and repetition."""
    return seed * 7919 + prompt_index


# -- configuration ------------------------------------------------------------------------------
@dataclass
class PriorityConfig:
    """Everything one ``bench-priority`` run depends on (all of it goes into the output)."""

    model_dir: str
    draft_dir: str
    arms: tuple[str, ...] = ARMS
    repetitions: int = 5
    prompts: tuple[str, ...] | None = None  # texts; None: the first n_prompts of DEFAULT_PROMPTS
    n_prompts: int = 3
    max_new_tokens: int = 32
    block_size: int | str | None = "auto"  # "auto": the block planner; None: the draft's trained block size
    draft_acceptance: float | None = None  # oracle-acceptance P; None: the draft's own proposals
    expert_cache_fraction: float | None = 0.25
    expert_cache_mib: float | None = None  # overrides the fraction
    device: str = "cpu"
    dtype: str | None = None  # compute dtype (default: the checkpoint's)
    link_gbps: float | None = None  # simulated host->device link (CPU only)
    seed: int = 0
    warmup: int = 1  # discarded rounds of every arm before the measured ones
    history_depth: int = 2  # history prefetch depth of the flat / banded / oracle arms
    predictor: str = "draft-router"  # route-ahead predictor of flat / banded
    workers: int = 2  # scheduler copy threads
    timeline: bool = True  # trace one step per prefetching arm for the link timeline
    peers: bool = False
    peer_new_tokens: int | None = None  # None: max_new_tokens
    peer_offload_new_tokens: int = 4
    peer_time_limit_s: float = 120.0
    output: str | None = None

    def validate(self) -> None:
        """Raise PdflashError on any bad setting, before anything is loaded: exit code 2 for a value
        that is wrong by itself (bad usage), 1 for one that does not fit the machine or the files."""
        import math

        from pdflash.offload.runtime import LINK_GBPS_MAX, LINK_GBPS_MIN

        def usage(msg: str) -> PdflashError:
            return PdflashError(msg, exit_code=2)

        if not self.arms:
            raise usage(f"no arm selected: choose from {', '.join(ARMS)}")
        unknown = [a for a in self.arms if a not in ARM_SPECS]
        if unknown:
            raise usage(f"unknown arm {unknown[0]!r}: choose from {', '.join(ARMS)}")
        dup = sorted({a for a in self.arms if self.arms.count(a) > 1})
        if dup:
            raise usage(f"arm {dup[0]!r} is named twice in --arms")
        if self.repetitions < 1:
            raise usage(f"--repetitions must be at least 1, got {self.repetitions}")
        if self.warmup < 0:
            raise usage(f"--warmup must be 0 or more, got {self.warmup}")
        if self.prompts is not None:
            if not self.prompts or any(not p.strip() for p in self.prompts):
                raise usage("--prompt texts must not be empty")
        elif not 1 <= self.n_prompts <= len(DEFAULT_PROMPTS):
            raise usage(f"--prompts must be between 1 and {len(DEFAULT_PROMPTS)} (the built-in prompts); "
                        f"give your own with --prompt TEXT, got {self.n_prompts}")
        if self.max_new_tokens < 2:
            raise usage(f"--max-new-tokens must be at least 2 (tokens/s needs a decode step), got {self.max_new_tokens}")
        if self.draft_acceptance is not None and not 0.0 <= self.draft_acceptance <= 1.0:
            raise usage(f"--draft-acceptance must be between 0 and 1, got {self.draft_acceptance}")
        if self.expert_cache_mib is not None:
            if not (math.isfinite(self.expert_cache_mib) and self.expert_cache_mib > 0):
                raise usage(f"--expert-cache-mib must be a positive finite number, got {self.expert_cache_mib}")
        elif self.expert_cache_fraction is None or not 0 < self.expert_cache_fraction <= 1:
            raise usage(f"--expert-cache-fraction must be in (0, 1], got {self.expert_cache_fraction}")
        if self.device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise usage(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.link_gbps is not None:
            if not (math.isfinite(self.link_gbps) and LINK_GBPS_MIN <= self.link_gbps <= LINK_GBPS_MAX):
                raise usage(f"--link-gbps must be between {LINK_GBPS_MIN:g} and {LINK_GBPS_MAX:g} (GB/s), "
                            f"got {self.link_gbps:g}")
            if self.device != "cpu":
                raise usage("--link-gbps simulates a link for --device cpu only; on CUDA the real link is used")
        if not 0 <= self.seed <= 2**63 - 1:
            raise usage(f"--seed must be between 0 and 2**63-1, got {self.seed}")
        if not (math.isfinite(self.peer_time_limit_s) and self.peer_time_limit_s > 0):
            raise usage(f"--peer-time-limit must be a positive number of seconds, got {self.peer_time_limit_s}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise PdflashError("--device cuda was asked for but no CUDA device is available; use --device cpu")
        from pdflash.draft.offloaded import parse_block_size

        self.block_size = parse_block_size(self.block_size)
        if isinstance(self.block_size, int) and self.block_size < 1:
            raise usage(f"--block-size must be at least 1, got {self.block_size}")
        if self.dtype is not None:
            from pdflash.offload.runtime import resolve_dtype

            resolve_dtype(self.dtype, None)  # an unknown name fails here, before any work
        from pdflash.draft.route_ahead import PREDICTORS, check_predictor_name

        check_predictor_name(self.predictor)
        if self.predictor == "none":
            raise usage(f"--predictor none leaves flat and banded without route-ahead: choose from {', '.join(PREDICTORS)}")
        if self.history_depth < 0:
            raise usage(f"--history-depth must be 0 or more, got {self.history_depth}")
        if self.workers < 1:
            raise usage(f"--workers must be at least 1, got {self.workers}")
        for name, d in (("--model", self.model_dir), ("--draft", self.draft_dir)):
            p = Path(d)
            if not p.is_dir():
                raise PdflashError(f"{name} {d}: no such directory")
            if not (p / "config.json").is_file():
                raise PdflashError(f"{name} {d}: no config.json; pass a checkpoint directory")
        mp = Path(self.model_dir)
        if not ((mp / "tokenizer.json").is_file() or (mp / "tokenizer_config.json").is_file()):
            raise PdflashError(f"--model {self.model_dir}: no tokenizer files (tokenizer.json); prompts cannot be encoded")
        if self.output is not None:
            check_writable(Path(self.output))

    def prompt_texts(self) -> tuple[str, ...]:
        return tuple(self.prompts) if self.prompts is not None else DEFAULT_PROMPTS[: self.n_prompts]


def check_writable(path: Path) -> None:
    """PdflashError unless ``path`` (and the PNG next to it) can be written; writes nothing."""
    import os

    if path.is_dir():
        raise PdflashError(f"--output {path} is a directory: give a file path such as {path / 'bm3.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise PdflashError(f"--output {path} cannot be written: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PdflashError(f"--output {path} cannot be written: the directory {parent} is not writable")
    for p in (path, path.with_suffix(".png")):
        if p.exists() and not os.access(p, os.W_OK):
            raise PdflashError(f"--output {path} cannot be written: {p} exists and is read-only")


@dataclass
class Budget:
    """Model shape and the expert-cache sizes the arms use (experts = (layer, expert) pairs)."""

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    block_size: int
    total_experts: int
    budget_experts: int  # capacity of the budget arms
    min_experts: int  # what one layer of one verify block may need at once
    allocated_experts: int  # slots allocated once (all experts when `resident` runs)

    @property
    def budget_bytes(self) -> int:
        return self.budget_experts * self.expert_bytes


def plan_budget(cfg: PriorityConfig) -> Budget:
    """Open and validate the checkpoints (no weights read) and size the cache; PdflashError if it cannot work."""
    from pdflash.draft.offloaded import draft_block_size
    from pdflash.offload.checkpoint import Checkpoint
    from pdflash.offload.runtime import min_cache_experts

    block = draft_block_size(cfg.draft_dir, cfg.block_size)
    with Checkpoint(cfg.model_dir) as ckpt:
        fam = ckpt.family
        stored = {piece: ckpt.dtype(src.first_name()) for piece, src in fam.expert_sources(0).items()}
        expert_bytes = fam.expert_layout(stored).expert_bytes
        L, E, K = fam.num_layers, fam.num_experts, fam.top_k
    total = L * E
    if cfg.expert_cache_mib is not None:
        n = min(total, int(cfg.expert_cache_mib * 2**20 // expert_bytes))
        asked = f"--expert-cache-mib {cfg.expert_cache_mib:g}"
    else:
        n = min(total, max(1, round(cfg.expert_cache_fraction * total)))
        asked = f"--expert-cache-fraction {cfg.expert_cache_fraction:g}"
    need = min_cache_experts(E, K, block)
    if n < need:
        raise PdflashError(f"{asked} gives {n} expert slots; a verify block of {block} tokens needs at least {need} "
                           f"({need * expert_bytes / 2**20:.1f} MiB): raise the cache size")
    allocated = total if "resident" in cfg.arms else n
    return Budget(L, E, K, expert_bytes, block, total, n, need, allocated)


# -- one loaded model, every arm -----------------------------------------------------------------
class _DecodeWindow:
    """Snapshot the runtime's counters when the second target forward of a run starts
    (the first after the prefill). Installed for one run."""

    def __init__(self, rt):
        self.rt = rt
        self.forwards = 0
        self.start: dict | None = None
        self.t_start: float | None = None
        self._h = rt.model.model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.forwards += 1
        if self.forwards == 2:
            self.start = counters(self.rt)
            self.t_start = time.monotonic()

    def close(self) -> None:
        self._h.remove()


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
        from pdflash.draft.model import load_draft
        from pdflash.offload.runtime import OffloadedModel

        cfg, b = self.cfg, self.budget
        t0 = time.perf_counter()
        self.rt = OffloadedModel.load(
            cfg.model_dir, device=cfg.device, dtype=cfg.dtype, expert_cache_experts=b.allocated_experts, block_tokens=b.block_size,
            link_gbps=cfg.link_gbps, workers=cfg.workers, lookahead_depth=0, history_depth=0,
            progress=sys.stderr.isatty(), trace=TRACE_EVENTS if cfg.timeline else 0,
        )
        self.draft = load_draft(cfg.draft_dir, self.rt.model)
        self.load_s = time.perf_counter() - t0
        tok = self.rt.tokenizer
        self.prompts = [list(tok.encode(t, add_special_tokens=False)) for t in cfg.prompt_texts()]
        if any(not p for p in self.prompts):
            raise PdflashError("a prompt encodes to no tokens: give non-empty prompts")

    def prepare(self) -> None:
        """Untimed per-prompt work: the greedy reference (oracle-acceptance mode) and the oracle
        arm's recorded verify experts."""
        from pdflash.draft.offloaded import oracle_reference
        from pdflash.offload.prompt import check_context

        rt, cfg = self.rt, self.cfg
        for prompt in self.prompts:  # every prompt fits before any of them runs
            check_context(rt.config, len(prompt), cfg.max_new_tokens)
        for pi, prompt in enumerate(self.prompts):
            ref = None
            if cfg.draft_acceptance is not None:  # from the verify path's arithmetic (draft/oracle.py)
                self.configure("on-demand")
                decoder = None
                if rt.device.type == "cuda":
                    from pdflash.offload.graphs import GraphedDecoder

                    decoder = GraphedDecoder.shared(rt, len(prompt) + cfg.max_new_tokens)
                    decoder.prepare(len(prompt), tokens=range(1, self.budget.block_size + 1))
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
        decoder = None
        if rt.device.type == "cuda":  # the graphed path, as speculative_on_runtime takes there
            from pdflash.offload.graphs import GraphedDecoder

            decoder = GraphedDecoder.shared(rt, len(prompt) + cfg.max_new_tokens)
            decoder.prepare(len(prompt), tokens=sorted({1, b.block_size}))
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
        window = _DecodeWindow(rt)
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


# -- statistics over samples ----------------------------------------------------------------------
SUMMARY_METRICS = (
    "exposed_fetch_s", "exposed_fetch_ms_per_step", "tokens_per_second", "tpot_ms", "acceptance_length",
    "hit_rate", "bytes_moved", "on_demand_stall_per_fetch_s", "exposed_fetch_total_s", "prefill_ms",
    "bytes_per_committed_token", "planner_predicted_step_ms", "planner_measured_step_ms", "planner_abs_error_ms",
)


def _values(samples: list[dict], arm: str, metric: str) -> list:
    return [s[metric] for s in samples if s["arm"] == arm]


def band_value(s: dict, band: str, key: str):
    lv = s.get("bands")
    return None if lv is None else lv[band][key]


def summarize(samples: list[dict], arms: tuple[str, ...], seed: int) -> dict:
    """{arm: {metric: {mean, lo, hi, n, median, missing}}}: 95 % bootstrap intervals of the mean."""
    out = {}
    for arm in arms:
        rows = [s for s in samples if s["arm"] == arm]
        m: dict = {}
        series = {k: [s[k] for s in rows] for k in SUMMARY_METRICS}
        for band in BAND_NAMES:
            for key in ("stall_s", "queue_wait_s", "bytes"):
                series[f"band.{band}.{key}"] = [band_value(s, band, key) for s in rows]
        for k, vals in series.items():
            m[k] = interval_of(vals, seed)
        hist: dict[str, int] = {}
        for r in rows:
            for b, n in (r.get("block_histogram") or {}).items():
                hist[b] = hist.get(b, 0) + n
        m["block_histogram"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        m["samples"] = len(rows)
        out[arm] = m
    return out


def interval_of(vals: list, seed: int) -> dict:
    have = [float(v) for v in vals if v is not None]
    missing = len(vals) - len(have)
    if not have:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "median": None, "missing": missing}
    iv = bstats.bootstrap_mean(have, seed=seed)
    srt = sorted(have)
    mid = len(srt) // 2
    med = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
    return {**iv.as_dict(), "median": med, "missing": missing}


def paired(samples: list[dict], a: str, b: str, metric: str) -> tuple[list, list]:
    """Values of ``metric`` for arms a and b over the (repetition, prompt) pairs both ran."""
    by = {(s["arm"], s["repetition"], s["prompt"]): s[metric] for s in samples}
    keys = sorted({(s["repetition"], s["prompt"]) for s in samples if s["arm"] == a}
                  & {(s["repetition"], s["prompt"]) for s in samples if s["arm"] == b})
    return [by[(a, *k)] for k in keys], [by[(b, *k)] for k in keys]


def noise(samples: list[dict], arms: tuple[str, ...], metric: str) -> float | None:
    """Run-to-run noise of ``metric``: pooled SD of the same arm and prompt across repetitions."""
    groups: dict = {}
    for s in samples:
        if s["arm"] in arms:
            groups.setdefault((s["arm"], s["prompt"]), []).append(s[metric])
    return bstats.run_to_run_noise(groups)


def instrumentation_checks(samples: list[dict]) -> dict:
    """Guards against the original system's failure modes, computed from the samples.

    - ``exposed_fetch_instrumented``: in every prefetching or on-demand run with misses in the
      decode window, exposed fetch is a positive number (0.0 with misses means the wait points
      are not instrumented).
    - ``resident_exposed_fetch_zero``: the resident arm had no miss and no exposed fetch.
    - ``oracle_prediction_exact``: the oracle arm's replayed prediction covered every used expert.
    - ``same_tokens``: every run produced the reference tokens (oracle-acceptance mode).
    """
    checks: dict = {}
    bad = [s for s in samples if s["arm"] != "resident" and (s["misses"] or 0) > 0
           and not (s["exposed_fetch_s"] is not None and s["exposed_fetch_s"] > 0)]
    checks["exposed_fetch_instrumented"] = {"ok": not bad, "failing_runs": len(bad)}
    res = [s for s in samples if s["arm"] == "resident"]
    if res:
        worst = max((s["exposed_fetch_total_s"] or 0.0) for s in res)
        misses = sum((s["misses"] or 0) for s in res)
        checks["resident_exposed_fetch_zero"] = {"ok": misses == 0 and worst < 1e-3, "max_exposed_fetch_s": worst,
                                                 "misses": misses}
    orc = [s for s in samples if s["arm"] == "oracle" and s["route_ahead"]]
    if orc:
        recall = min(s["route_ahead"]["recall"] for s in orc)
        checks["oracle_prediction_exact"] = {"ok": recall == 1.0, "min_recall": recall}
    same = [s["same_tokens_as_reference"] for s in samples if s["same_tokens_as_reference"] is not None]
    if same:
        checks["same_tokens"] = {"ok": all(same), "differing_runs": same.count(False)}
    refresh = sum(s["oracle_refreshes"] or 0 for s in samples)
    checks["oracle_refreshes"] = {"ok": refresh == 0, "count": refresh,
                                  "note": "refresh forwards (oracle divergence repair) run inside the decode window"
                                  + ("; in bf16 on random weights, block and single-token forwards round apart: "
                                     "--dtype float32 avoids the repairs" if refresh else "")}
    return checks


def make_decision(samples: list[dict], arms: tuple[str, ...], checks: dict, seed: int) -> tuple[bstats.Decision, dict]:
    """The verdict from the paired banded / flat samples (pairs = same repetition and prompt)."""
    missing_arms = [a for a in ("flat", "banded") if a not in arms]
    if missing_arms:
        d = bstats.Decision("unmeasurable", [f"the {' and '.join(missing_arms)} arm(s) did not run; "
                                             "the decision compares banded against flat"])
        return d, {}
    eb, ef = paired(samples, "banded", "flat", "exposed_fetch_s")
    if not checks["exposed_fetch_instrumented"]["ok"]:
        eb = [None] * len(eb)  # a 0.0 from an uninstrumented wait must not enter a comparison
    tb, tf = paired(samples, "banded", "flat", "tokens_per_second")
    ob, of = paired(samples, "banded", "flat", "on_demand_stall_per_fetch_s")
    tps_noise = noise(samples, ("flat", "banded"), "tokens_per_second")
    od_noise = noise(samples, ("flat", "banded"), "on_demand_stall_per_fetch_s")
    dec = bstats.decide(eb, ef, tb, tf, ob, of, tps_noise, od_noise, seed=seed)
    inputs = {"pairs": len(eb), "tokens_per_second_noise": tps_noise, "on_demand_stall_noise_s": od_noise}
    if not checks["exposed_fetch_instrumented"]["ok"]:
        dec.reasons.insert(0, "exposed fetch read 0 in runs that missed: the wait points are not instrumented")
    return dec, inputs


def paired_table(samples: list[dict], arms: tuple[str, ...], seed: int) -> dict:
    """Paired differences (mean, 95 % interval) of the main metrics: banded - flat, oracle - banded,
    flat - on-demand, banded - on-demand."""
    out = {}
    for a, b in (("banded", "flat"), ("oracle", "banded"), ("flat", "on-demand"), ("banded", "on-demand")):
        if a not in arms or b not in arms:
            continue
        row = {}
        for metric in ("exposed_fetch_s", "tokens_per_second", "on_demand_stall_per_fetch_s", "hit_rate", "bytes_moved"):
            xa, xb = paired(samples, a, b, metric)
            iv = bstats.paired_difference(xa, xb, seed=seed)
            row[metric] = iv.as_dict() if iv else None
        out[f"{a} - {b}"] = row
    return out


# -- machine and the whole run --------------------------------------------------------------------
def run_priority_bench(cfg: PriorityConfig, log: Callable[[str], None] = lambda m: None) -> dict:
    """Validate, load once, run every arm, decide; returns the result dict (see ``SCHEMA``).

    Every PdflashError about the input is raised before the model is loaded.
    """
    cfg.validate()
    budget = plan_budget(cfg)
    t_start = time.perf_counter()
    bench = PriorityBench(cfg, budget, log)
    samples: list[dict] = []
    orders: list[list[str]] = []
    timeline = None
    peers_out = None
    try:
        log(f"loading {cfg.model_dir} on {cfg.device} ({budget.allocated_experts} expert slots of "
            f"{budget.expert_bytes / 2**20:.2f} MiB; budget {budget.budget_experts}/{budget.total_experts})")
        bench.load()
        log(f"loaded in {bench.load_s:.1f} s; preparing {len(bench.prompts)} prompt(s)")
        bench.prepare()
        warm = 0
        for w in range(cfg.warmup):
            order = list(cfg.arms)
            random.Random(order_seed(cfg.seed, -1 - w)).shuffle(order)
            for arm in order:
                bench.run_one(arm, w % len(bench.prompts))
                warm += 1
        if warm:
            log(f"warm-up: {warm} run(s) discarded")
        per_rep = len(bench.prompts) * len(cfg.arms)
        total = cfg.repetitions * per_rep
        done = 0
        interrupted = False
        try:
            for rep in range(cfg.repetitions):
                order = list(cfg.arms)
                random.Random(order_seed(cfg.seed, rep)).shuffle(order)
                orders.append(order)
                for pi in range(len(bench.prompts)):
                    for pos, arm in enumerate(order):
                        s = bench.run_one(arm, pi)
                        s.update(arm=arm, repetition=rep, prompt=pi, order_position=pos)
                        samples.append(s)
                        done += 1
                        log(_progress_line(done, total, s))
        except KeyboardInterrupt:  # keep the repetitions that finished; the result is marked partial
            interrupted = True
            finished = len(samples) // per_rep
            samples, orders = samples[: finished * per_rep], orders[:finished]
            if not finished:
                raise Interrupted("stopped by Ctrl-C before the first repetition finished; nothing was written") from None
            log(f"interrupted: keeping the {finished} finished repetition(s) of {cfg.repetitions}")
        if cfg.timeline and not interrupted:
            try:
                timeline = trace_steps(bench, [a for a in ("flat", "banded") if a in cfg.arms], log)
            except Exception as exc:  # noqa: BLE001 - the figure loses its timeline, the measurements stand
                timeline = {"available": False, "reason": f"tracing failed: {type(exc).__name__}: {exc}"}
                log(f"Warning: timeline not recorded ({timeline['reason']})")
            except KeyboardInterrupt:  # every repetition finished: keep them, without the timeline
                interrupted = True
                timeline = {"available": False, "reason": "interrupted"}
        switches = bench.switches
        rt_stats_final = bench.rt.stats()
        setup = {
            "expert_bytes": budget.expert_bytes,
            "num_layers": budget.num_layers, "num_experts": budget.num_experts, "top_k": budget.top_k,
            "total_experts": budget.total_experts, "budget_experts": budget.budget_experts,
            "budget_bytes": budget.budget_bytes, "allocated_experts": budget.allocated_experts,
            "min_experts": budget.min_experts, "block_size": budget.block_size, "block_mode": cfg.block_size,
            "expert_format": rt_stats_final["expert_format"], "dtype": rt_stats_final["dtype"],
            "load_s": bench.load_s, "prompt_tokens": [len(p) for p in bench.prompts],
            "oracle_seeds": [oracle_seed(cfg.seed, i) for i in range(len(bench.prompts))],
            "warmup_runs": warm, "arm_switches": switches,
        }
        prompts_ids = bench.prompts
        dtype_name = rt_stats_final["dtype"]
    finally:
        if bench.rt is not None:
            bench.rt.close()  # terminal, once, after the last arm
        bench.rt = bench.draft = None
    if cfg.peers and not interrupted:
        _free_memory()
        try:
            peers_out = run_peers_side_by_side(cfg, budget, prompts_ids, dtype_name, samples, log)
        except PdflashError as exc:  # the pdflash arms are measured; keep them
            peers_out = {"error": str(exc)}
            log(f"Warning: peers not measured: {exc}")
        except KeyboardInterrupt:
            interrupted = True
            peers_out = {"error": "interrupted"}
    checks = instrumentation_checks(samples)
    decision, inputs = make_decision(samples, cfg.arms, checks, cfg.seed)
    result = {
        "schema": SCHEMA,
        "config": {**asdict(cfg), "prompt_texts": list(cfg.prompt_texts()), "arm_orders": orders,
                   "order_seeds": [order_seed(cfg.seed, r) for r in range(len(orders))],
                   "bootstrap_seed": cfg.seed, "bootstrap_resamples": 4000, "interval_level": 0.95,
                   "arm_specs": {a: asdict(ARM_SPECS[a]) for a in cfg.arms},
                   "oracle_acceptance_mode": cfg.draft_acceptance is not None,
                   "metric_windows": "decode window = from the start of the first target forward after the prefill "
                                     "to the end of generation; *_total_* and prefill_* include the prefill"},
        "machine": machine_info(cfg.device),
        "setup": setup,
        "samples": samples,
        "summary": summarize(samples, cfg.arms, cfg.seed),
        "paired": paired_table(samples, cfg.arms, cfg.seed),
        "checks": checks,
        "decision": {**decision.as_dict(), "inputs": inputs},
        "timeline": timeline,
        "peers": peers_out,
        "wall_s": time.perf_counter() - t_start,
    }
    if interrupted:
        result["partial"] = {"interrupted": True, "repetitions_finished": len(orders),
                             "repetitions_asked": cfg.repetitions}
    return result


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress_line(done: int, total: int, s: dict) -> str:
    def f(v, spec, scale=1.0):
        return "n/a" if v is None else format(v * scale, spec)

    return (f"[{done}/{total}] rep {s['repetition']} prompt {s['prompt']} {s['arm']:<9}: "
            f"{f(s['tokens_per_second'], '.2f')} tok/s, exposed fetch {f(s['exposed_fetch_s'], '.2f', 1e3)} ms, "
            f"hit rate {f(s['hit_rate'], '.2f')}, accept {f(s['acceptance_length'], '.2f')}")


# -- peers ------------------------------------------------------------------------------------------
def run_peers_side_by_side(cfg: PriorityConfig, budget: Budget, prompts: list[list[int]], dtype: str,
                           samples: list[dict], log: Callable[[str], None]) -> dict:
    """bench/peers arms on the same prompts; the accelerate arm's GPU budget is pdflash's expert
    budget plus its resident non-expert weights. Ratios = pdflash arm mean tokens/s / peer tokens/s."""
    from pdflash.bench import peers

    import torch

    dense = peers.gpu_budget_bytes(cfg.model_dir, 0.0, dtype)
    gpu_budget = dense + budget.budget_bytes
    arms = [peers.RESIDENT]
    skipped = {}
    if cfg.device.startswith("cuda") and torch.cuda.is_available():
        arms.append(peers.ACCELERATE_OFFLOAD)
    else:
        skipped[peers.ACCELERATE_OFFLOAD] = "needs a CUDA GPU (its GPU memory cap is the point of the arm)"
    pcfg = peers.PeerConfig(
        model_dir=cfg.model_dir, prompts=prompts, gpu_budget_gib=gpu_budget / peers.GIB, arms=tuple(arms),
        new_tokens=cfg.peer_new_tokens or cfg.max_new_tokens, offload_new_tokens=cfg.peer_offload_new_tokens,
        time_limit_s=cfg.peer_time_limit_s, dtype=dtype, device=cfg.device,
    )
    log(f"peers: {', '.join(arms)} on the same {len(prompts)} prompt(s); accelerate GPU budget "
        f"{_size(gpu_budget)} = non-expert weights {_size(dense)} + expert budget {_size(budget.budget_bytes)}")
    results = peers.run_peers(pcfg, log=log)
    ratios = {}
    for arm in cfg.arms:
        tps = [s["tokens_per_second"] for s in samples if s["arm"] == arm]
        mean_tps = bstats.mean(tps) if tps and all(t is not None for t in tps) else None
        ratios[arm] = peers.tokens_per_second_ratios({"tokens_per_second": mean_tps}, results)
    return {
        "gpu_budget_bytes": gpu_budget,
        "non_expert_bytes": dense,
        "expert_budget_bytes": budget.budget_bytes,
        "arms": results,
        "skipped": skipped,
        "ratios": ratios,
        "note": ("pdflash arms decode speculatively with the DFlash draft"
                 + (f" in oracle-acceptance mode (P = {cfg.draft_acceptance})" if cfg.draft_acceptance is not None else "")
                 + "; peers decode plain greedy (one token per forward); all produce the target's greedy tokens"),
    }


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


__all__ = [
    "ARMS", "ARM_SPECS", "ArmSpec", "Budget", "DEFAULT_PROMPTS", "PriorityBench", "PriorityConfig", "SCHEMA",
    "VERDICTS", "check_writable", "counters", "instrumentation_checks", "make_decision", "noise", "order_seed",
    "oracle_seed", "paired", "paired_table", "plan_budget", "run_priority_bench", "sample_metrics", "summarize",
]
