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

Modules: :mod:`~pdflash.bench.config` (arms, prompts, settings), :mod:`~pdflash.bench.budget` (the
expert-cache budget), :mod:`~pdflash.bench.runner` (the loaded model and the runs),
:mod:`~pdflash.bench.decision` (statistics and verdict), :mod:`~pdflash.bench.stats` (the
bootstrap), :mod:`~pdflash.bench.peers` (peer baselines) and :mod:`~pdflash.bench.report` (output).
This module runs them in order: :func:`run_priority_bench`.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from typing import Callable

from pdflash import Interrupted, PdflashError
from pdflash.bench import stats as bstats
from pdflash.bench.budget import Budget, plan_budget
from pdflash.bench.config import ARM_SPECS, PriorityConfig, oracle_seed, order_seed
from pdflash.bench.decision import instrumentation_checks, make_decision, paired_table, summarize
from pdflash.bench.runner import PriorityBench, trace_steps
from pdflash.machine import machine_info

SCHEMA = "pdflash.bench-priority/1"


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
