"""The embedded model pair (models/stdlib-moe) measured with pdflash's own runtime and commands.

    python benchmarks/bench_embedded.py --out results.json [--prompts 12] [--max-new-tokens 64]

Five measurements, all on the offloaded runtime (``OffloadedModel``, bf16, the checkpoint's dtype):

1. held-out loss: mean next-token cross-entropy (nats) of the target over non-overlapping
   256-token windows of the held-out files of *this* machine's standard library (the
   ``is_held_out`` rule and stream encoding of tools/train_embedded.py, the shipped tokenizer);
2. acceptance: speculative decoding (``speculative_on_runtime``, the loop ``pdflash generate``
   runs) with the draft at its trained block size, greedy, on prompts that are the first
   ``--prefix-tokens`` tokens of held-out files; every output is checked token by token
   against target-only greedy decoding (``greedy_generate``). To compare with
   models/stdlib-moe/training.json, also on ``--window-prompts`` random 64-token windows of
   the held-out stream, drawn as tools/train_draft.py's quick check draws them (seed 13);
3. route-ahead: recall and precision of each predictor against the experts the verify passes
   used, one run per predictor with an expert cache of ``--cache-experts`` slots (fewer than all
   experts, so prefetch decides hits), plus the runtime's own hit rate and prefetch counters;
4. concentration: share of routed (layer, expert) uses served by the most-used 25 % of experts,
   per layer and overall, from the runtime's routing observer (``rt.record_routing``), for
   target-only decoding (one token per forward: a use is one token's top-k choice) and for the
   verify passes (a use is one expert a verify pass needed: what the expert cache serves); next
   to 25 % and to the same statistic under uniform random routing with the same sample size;
5. ``pdflash bench-priority --link-gbps 0.2`` run as a subprocess (the real CLI, its defaults
   otherwise: the embedded pair), its JSON and PNG written next to ``--out``.

Stdout: readable tables, then the headline numbers exactly; ``--out``: everything as JSON.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "pdflash.bench-embedded/1"
PREDICTORS = ("draft-router", "previous", "lookahead", "draft-router+previous+lookahead")
TEST_DIRS = {"test", "tests", "idle_test"}  # path parts that mark test-suite files
SEQ = 256  # window length of the held-out loss, as tools/train_embedded.py measures it


sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ itself, also when imported by path
from _checkout import import_pdflash as _import_pdflash  # noqa: E402


def _train_embedded():
    """tools/train_embedded.py as a module (its corpus rule and stream encoding)."""
    spec = importlib.util.spec_from_file_location("train_embedded", ROOT / "tools" / "train_embedded.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- held-out corpus ----------------------------------------------------------------------------
def held_out_files(max_file_bytes: int = 200_000) -> tuple[str, list[tuple[str, str]]]:
    """(stdlib root, [(relative path, text)]) of this Python's held-out files, sorted by path,
    with the filters of train_embedded.read_corpus (UTF-8, not blank, at most max_file_bytes)."""
    te = _train_embedded()
    root, files = te.stdlib_files()
    out = []
    for p in files:
        rel = str(p.relative_to(root))
        if not te.is_held_out(rel):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and len(text) <= max_file_bytes:
            out.append((rel, text))
    return str(root), out


def load_tokenizer():
    """The shipped byte-level BPE tokenizer (``tokenizers.Tokenizer``, as the training script uses it)."""
    from tokenizers import Tokenizer

    from pdflash.offload.embedded import embedded_target

    return Tokenizer.from_file(str(embedded_target() / "tokenizer.json"))


def encode_stream(tok, files: list[tuple[str, str]]) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
    """The held-out token stream as train_embedded.encode_all builds it (each file's ids, then
    <|endoftext|>), and each file's [start, end) span in it."""
    te = _train_embedded()
    parts, spans, pos = [], [], 0
    for rel, text in files:
        ids = te.encode_all(tok, [text])  # [n + 1] int32, eos last
        parts.append(ids)
        spans.append((rel, pos, pos + ids.numel()))
        pos += ids.numel()
    return torch.cat(parts), spans


def is_test_file(rel: str) -> bool:
    return bool(TEST_DIRS & set(Path(rel).parts[:-1]))


@torch.no_grad()
def held_out_loss(rt, stream: torch.Tensor, spans: list[tuple[str, int, int]], *, seq: int = SEQ,
                  max_windows: int | None = 256, batch: int = 16) -> dict:
    """Mean next-token cross-entropy (nats) of ``rt``'s model over non-overlapping windows of
    ``seq + 1`` tokens of ``stream`` (as train_embedded.held_out_loss: each window predicts its
    last ``seq`` tokens from the ones before). With more windows than ``max_windows``, that many
    are taken evenly spaced over the stream so every part of it is sampled. A predicted token is
    counted for the file it belongs to (an <|endoftext|> for the file it ends)."""
    n_all = stream.numel() // (seq + 1)
    windows = stream[: n_all * (seq + 1)].view(n_all, seq + 1).long()  # [W, seq + 1]
    if max_windows is not None and n_all > max_windows:
        pick = torch.linspace(0, n_all - 1, max_windows).round().long().unique()
    else:
        pick = torch.arange(n_all)
    file_of = torch.empty(stream.numel(), dtype=torch.long)  # token position -> file index
    for i, (_, a, b) in enumerate(spans):
        file_of[a:b] = i
    nll_sum = torch.zeros(len(spans), dtype=torch.float64)
    count = torch.zeros(len(spans), dtype=torch.long)
    t0 = time.perf_counter()
    for i in range(0, pick.numel(), batch):
        w = pick[i : i + batch]
        x = windows[w]  # [b, seq + 1]
        logits = rt.forward(x[:, :-1]).logits.float()  # [b, seq, V]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1).to(logits.device),
                                                reduction="none").double().cpu()  # [b * seq]
        pos = (w[:, None] * (seq + 1) + torch.arange(1, seq + 1)[None]).reshape(-1)  # stream index of each target
        f = file_of[pos]
        nll_sum.index_add_(0, f, nll)
        count.index_add_(0, f, torch.ones_like(f))
    seconds = time.perf_counter() - t0
    per_file = [{"file": rel, "tokens": int(count[i]), "loss": float(nll_sum[i] / count[i]) if count[i] else None}
                for i, (rel, _, _) in enumerate(spans)]

    def group(pred: Callable[[str], bool]) -> dict:
        idx = [i for i, (rel, _, _) in enumerate(spans) if pred(rel)]
        n = int(count[idx].sum()) if idx else 0
        return {"files": len(idx), "tokens": n, "loss": float(nll_sum[idx].sum() / n) if n else None}

    total = int(count.sum())
    return {
        "loss": float(nll_sum.sum() / total),
        "tokens": total,
        "windows": int(pick.numel()),
        "windows_available": int(n_all),
        "window_tokens": seq,
        "stream_tokens": int(stream.numel()),
        "dtype": str(rt.dtype).replace("torch.", ""),
        "seconds": seconds,
        "groups": {
            "library": group(lambda r: not is_test_file(r)),
            "test_suite": group(is_test_file),
        },
        "per_file": per_file,
    }


def prompt_prefixes(tok, files: list[tuple[str, str]], n: int, prefix_tokens: int) -> list[tuple[str, list[int]]]:
    """The first ``prefix_tokens`` ids of ``n`` held-out files, evenly spaced over the sorted
    files that are at least twice that long."""
    long_enough = []
    for rel, text in files:
        ids = tok.encode(text).ids
        if len(ids) >= 2 * prefix_tokens:
            long_enough.append((rel, ids[:prefix_tokens]))
    if n > len(long_enough):
        raise SystemExit(f"only {len(long_enough)} held-out files have {2 * prefix_tokens} tokens; ask for fewer --prompts")
    step = len(long_enough) / n
    return [long_enough[int(i * step)] for i in range(n)]


# -- generations --------------------------------------------------------------------------------
def top_share(counts: torch.Tensor, fraction: float = 0.25) -> dict:
    """counts [L, E] of (layer, expert) uses -> share of the uses served by the most-used
    ``fraction`` of experts: per layer (top fraction of that layer's E) and overall (top
    fraction of all L * E pairs)."""
    L, E = counts.shape
    k_layer = max(1, round(fraction * E))
    k_all = max(1, round(fraction * L * E))
    totals = counts.sum(dim=1).double()
    per_layer = (counts.sort(dim=1, descending=True).values[:, :k_layer].sum(dim=1).double() / totals.clamp_min(1)).tolist()
    flat = counts.reshape(-1).sort(descending=True).values
    total = float(flat.sum())
    return {
        "per_layer": per_layer,
        "layer_mean": sum(per_layer) / L,
        "overall": float(flat[:k_all].sum()) / total if total else None,
        "experts_per_layer_in_top": k_layer,
        "experts_in_top_overall": k_all,
        "uses": int(total),
    }


def uniform_top_share(tokens_per_forward: list[int], num_layers: int, num_experts: int, top_k: int,
                      fraction: float = 0.25, repeats: int = 50, seed: int = 0) -> dict:
    """Expected ``top_share`` when every token picks ``top_k`` of ``num_experts`` uniformly at
    random, with the same forwards (tokens each) as the measured sample; a forward's use of an
    expert counts once however many of its tokens picked it, as the routing observer reports."""
    gen = torch.Generator().manual_seed(seed)
    per_layer, overall = [], []
    by_size: dict[int, int] = {}
    for t in tokens_per_forward:
        by_size[t] = by_size.get(t, 0) + 1
    for _ in range(repeats):
        counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        for t, nf in by_size.items():
            picks = torch.rand(nf, t, num_layers, num_experts, generator=gen).topk(top_k, dim=-1).indices  # [F, t, L, k]
            used = torch.zeros(nf, t, num_layers, num_experts, dtype=torch.bool)
            used.scatter_(-1, picks, True)
            counts += used.any(dim=1).sum(dim=0)  # [L, E]: forwards that used each expert
        s = top_share(counts, fraction)
        per_layer.append(s["layer_mean"])
        overall.append(s["overall"])
    return {"layer_mean": sum(per_layer) / repeats, "overall": sum(overall) / repeats, "repeats": repeats}


def _counts(forwards: list[dict[int, list[int]]], num_layers: int, num_experts: int) -> torch.Tensor:
    c = torch.zeros(num_layers, num_experts, dtype=torch.long)
    for fwd in forwards:
        for layer, experts in fwd.items():
            c[layer, experts] += 1
    return c


def run_generations(rt, draft, prompts: list[tuple[str, list[int]]], max_new_tokens: int, *,
                    cache_experts: int, predictors: tuple[str, ...] = PREDICTORS, log: Callable[[str], None] = _log) -> dict:
    """Per prompt: target-only greedy decoding (the reference, routing recorded), then one
    speculative run per route-ahead predictor from an empty cache of ``cache_experts`` slots.

    Returns {"prompts": [per-prompt records], "routing": {"decode": forwards, "verify": forwards,
    "verify_tokens": [tokens per verify pass]}} where forwards are the routing observer's
    per-forward {layer: experts} (prefill forwards left out)."""
    from pdflash.draft import greedy_generate, speculative_on_runtime

    eos = rt.eos_token_ids
    records = []
    decode_fwd: list[dict[int, list[int]]] = []
    verify_fwd: list[dict[int, list[int]]] = []
    verify_tokens: list[int] = []
    for pi, (name, prompt) in enumerate(prompts):
        rt.reset_cache(capacity_experts=cache_experts)
        t0 = time.perf_counter()
        with rt.record_routing() as rec:
            reference = greedy_generate(rt.model, prompt, max_new_tokens, eos)
        ref_s = time.perf_counter() - t0
        if len(rec.forwards) != len(reference):  # prefill + one forward per later token
            raise RuntimeError(f"recorded {len(rec.forwards)} forwards for {len(reference)} greedy tokens")
        decode_fwd += rec.forwards[1:]
        runs = {}
        for j, pred in enumerate(predictors):
            rt.reset_cache(capacity_experts=cache_experts)
            sizes: list[int] = []
            t0 = time.perf_counter()
            with rt.record_routing() as rec:
                res = speculative_on_runtime(rt, draft, prompt, max_new_tokens, predictor=pred,
                                             on_step=lambda info: sizes.append(info.block_size))
            seconds = time.perf_counter() - t0
            st = res.stats
            if len(rec.forwards) != st.verify_steps + 1:
                raise RuntimeError(f"recorded {len(rec.forwards)} forwards for {st.verify_steps} verify passes + prefill")
            if j == 0:  # routing is the same in every run (same tokens); count it once
                verify_fwd += rec.forwards[1:]
                verify_tokens += sizes
            rs = rt.stats()
            mismatch = next((i for i, (a, b) in enumerate(zip(res.token_ids, reference)) if a != b), None)
            if mismatch is None and len(res.token_ids) != len(reference):
                mismatch = min(len(res.token_ids), len(reference))
            runs[pred] = {
                "tokens": len(res.token_ids),
                "lossless": mismatch is None,
                "first_mismatch": mismatch,
                "verify_steps": st.verify_steps,
                "committed_tokens": st.committed_tokens,
                "acceptance_length": st.acceptance_length,
                "drafted_per_position": list(st.drafted_per_position),
                "accepted_per_position": list(st.accepted_per_position),
                "route_ahead": res.route_ahead,
                "cache": {k: rs["cache"][k] for k in ("slots", "hits", "misses", "hit_rate", "evictions")},
                "prefetch": {"issued": sum(rs["prefetch"]["issued"].values()), "used": rs["prefetch"]["used"],
                             "wasted": rs["prefetch"]["wasted"]},
                "demand_fetches": rs["demand_fetches"],
                "bytes_moved": rs["bytes_moved"],
                "seconds": seconds,
                "tokens_per_second": res.tokens_per_second,
            }
        first = runs[predictors[0]]
        records.append({"file": name, "prompt_tokens": len(prompt), "reference_tokens": len(reference),
                        "reference_seconds": ref_s, "runs": runs})
        log(f"prompt {pi + 1}/{len(prompts)} {name}: acceptance {first['acceptance_length']:.2f} "
            f"({first['verify_steps']} verify passes), lossless {all(r['lossless'] for r in runs.values())}")
    return {"prompts": records, "routing": {"decode": decode_fwd, "verify": verify_fwd, "verify_tokens": verify_tokens}}


def acceptance_on_windows(rt, draft, stream: torch.Tensor, n: int, *, max_new_tokens: int = 64,
                          prompt_tokens: int = 64, seed: int = 13) -> dict:
    """Acceptance on ``n`` random windows of the held-out stream, drawn as tools/train_draft.py's
    quick check draws them (``torch.Generator().manual_seed(seed)``, one randint per prompt), no
    route-ahead; reported as the training record reports it (mean of per-prompt acceptance) and
    pooled (committed tokens / verify passes)."""
    from pdflash.draft import speculative_on_runtime

    gen = torch.Generator().manual_seed(seed)
    per_prompt, committed, steps, starts = [], 0, 0, []
    for _ in range(n):
        s = int(torch.randint(0, stream.numel() - prompt_tokens - 1, (1,), generator=gen))
        starts.append(s)
        rt.reset_cache()
        res = speculative_on_runtime(rt, draft, stream[s : s + prompt_tokens].tolist(), max_new_tokens, predictor=None,
                                     eos_token_ids=())  # as the quick check: no stop at <|endoftext|>
        per_prompt.append(res.stats.acceptance_length)
        committed += res.stats.committed_tokens
        steps += res.stats.verify_steps
    return {
        "prompts": n, "seed": seed, "starts": starts,
        "acceptance_length": committed / steps if steps else None,
        "acceptance_length_prompt_mean": sum(per_prompt) / n if n else None,
        "per_prompt": per_prompt,
        "median": statistics.median(per_prompt) if n else None,
    }


# -- summaries ----------------------------------------------------------------------------------
def acceptance_summary(gen: dict, predictor: str = PREDICTORS[0]) -> dict:
    """Acceptance of the draft over every prompt (pooled: committed / verify passes) and per prompt."""
    runs = [p["runs"][predictor] for p in gen["prompts"]]
    per_prompt = [r["acceptance_length"] for r in runs]
    drafted = [sum(col) for col in zip(*(r["drafted_per_position"] for r in runs))]
    accepted = [sum(col) for col in zip(*(r["accepted_per_position"] for r in runs))]
    mismatches = [{"file": p["file"], "predictor": name, "first_mismatch": r["first_mismatch"]}
                  for p in gen["prompts"] for name, r in p["runs"].items() if not r["lossless"]]
    return {
        "block_size": len(drafted) + 1,
        "prompts": len(runs),
        "verify_steps": sum(r["verify_steps"] for r in runs),
        "committed_tokens": sum(r["committed_tokens"] for r in runs),
        "acceptance_length": sum(r["committed_tokens"] for r in runs) / max(1, sum(r["verify_steps"] for r in runs)),
        "acceptance_length_prompt_mean": sum(per_prompt) / len(per_prompt),
        "per_prompt": {"min": min(per_prompt), "median": statistics.median(per_prompt), "max": max(per_prompt),
                       "values": {p["file"]: a for p, a in zip(gen["prompts"], per_prompt)}},
        "acceptance_per_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "runs_checked": sum(len(p["runs"]) for p in gen["prompts"]),
        "lossless": not mismatches,
        "mismatches": mismatches,
    }


def route_ahead_summary(gen: dict) -> dict:
    """Per predictor, pooled over prompts: recall = hits / used, precision = hits / predicted
    (route-ahead's own counters), and the runtime's cache hit rate and prefetch counters."""
    out = {}
    names = list(gen["prompts"][0]["runs"])
    for name in names:
        runs = [p["runs"][name] for p in gen["prompts"]]
        ra = [r["route_ahead"] for r in runs]
        hits, misses = sum(r["cache"]["hits"] for r in runs), sum(r["cache"]["misses"] for r in runs)
        row = {
            "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
            "prefetch_issued": sum(r["prefetch"]["issued"] for r in runs),
            "prefetch_used": sum(r["prefetch"]["used"] for r in runs),
            "prefetch_wasted": sum(r["prefetch"]["wasted"] for r in runs),
            "demand_fetches": sum(r["demand_fetches"] for r in runs),
            "bytes_moved": sum(r["bytes_moved"] for r in runs),
        }
        if all(a is not None for a in ra):
            n_layers = len(ra[0]["per_layer"])
            h, u, p = (sum(a[k] for a in ra) for k in ("hits", "used", "predicted"))
            layer = [{k: sum(a["per_layer"][l][k] for a in ra) for k in ("hits", "used", "predicted")} for l in range(n_layers)]
            row.update({
                "recall": h / u if u else None,
                "precision": h / p if p else None,
                "hits": h, "used": u, "predicted": p,
                "recall_per_layer": [x["hits"] / x["used"] if x["used"] else None for x in layer],
                "precision_per_layer": [x["hits"] / x["predicted"] if x["predicted"] else None for x in layer],
            })
        out[name] = row
    return out


def concentration_summary(gen: dict, num_layers: int, num_experts: int, top_k: int, fraction: float = 0.25) -> dict:
    """Top-``fraction`` share of (layer, expert) uses, for target-only decoding (per token) and
    for verify passes (per pass), each next to uniform routing with the same sample size."""
    r = gen["routing"]
    out = {"fraction": fraction, "uniform_expectation": fraction}
    for key, forwards, sizes in (("decode_per_token", r["decode"], [1] * len(r["decode"])),
                                 ("verify_per_pass", r["verify"], r["verify_tokens"])):
        counts = _counts(forwards, num_layers, num_experts)
        out[key] = {
            "forwards": len(forwards),
            **top_share(counts, fraction),
            "uniform_same_sample": uniform_top_share(sizes, num_layers, num_experts, top_k, fraction),
            "counts": counts.tolist(),
        }
    return out


# -- bench-priority -----------------------------------------------------------------------------
def run_bench_priority(output: Path, link_gbps: float = 0.2, log: Callable[[str], None] = _log) -> dict:
    """``python -m pdflash.cli.main bench-priority --link-gbps G --output OUTPUT``; the headline of its JSON."""
    cmd = [sys.executable, "-m", "pdflash.cli.main", "bench-priority", "--link-gbps", f"{link_gbps:g}", "--output", str(output)]
    log("running: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = {"command": "python " + " ".join(cmd[1:]), "returncode": proc.returncode, "wall_seconds": wall,
           "json": str(output), "png": str(output.with_suffix(".png"))}
    if proc.returncode != 0 or not output.is_file():
        out["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return out
    out.update(bench_priority_headline(json.loads(output.read_text())))
    out["table"] = proc.stdout
    return out


def bench_priority_headline(result: dict) -> dict:
    """Verdict, reasons and per-arm means / 95 % intervals of a bench-priority result."""
    def iv(x):
        return None if not x or x.get("mean") is None else {"mean": x["mean"], "lo": x.get("lo"), "hi": x.get("hi")}

    arms = {}
    for arm in result["config"]["arms"]:
        m = result["summary"][arm]
        arms[arm] = {
            "exposed_fetch_s": iv(m["exposed_fetch_s"]),
            "exposed_fetch_ms_per_step": m["exposed_fetch_ms_per_step"]["mean"],
            "tokens_per_second": iv(m["tokens_per_second"]),
            "acceptance_length": m["acceptance_length"]["mean"],
            "hit_rate": m["hit_rate"]["mean"],
            "bytes_moved": m["bytes_moved"]["mean"],
        }
    paired = {k: {"exposed_fetch_s": iv(v["exposed_fetch_s"]), "tokens_per_second": iv(v["tokens_per_second"])}
              for k, v in (result.get("paired") or {}).items()}
    setup = result["setup"]
    return {
        "verdict": result["decision"]["verdict"],
        "reasons": result["decision"]["reasons"],
        "checks_failed": [k for k, v in result["checks"].items() if not v.get("ok")],
        "setup": {k: setup.get(k) for k in ("block_size", "budget_experts", "total_experts", "prompt_tokens")},
        "config": {k: result["config"].get(k) for k in ("repetitions", "max_new_tokens", "link_gbps", "device",
                                                          "expert_cache_fraction", "predictor", "history_depth")},
        "arms": arms,
        "paired": paired,
    }


# -- report -------------------------------------------------------------------------------------
def machine_info(stdlib_root: str) -> dict:
    """pdflash.machine's record of this machine, plus the stdlib the held-out files come from."""
    from pdflash.machine import machine_info as _machine

    return dict(_machine("cpu"), stdlib=stdlib_root)


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 150)
    m = result["machine"]
    con.print(f"machine: {m['cpus']} CPUs, Python {m['python']} (stdlib {m['stdlib']}), torch {m['torch']}, "
              f"pdflash from {m['pdflash_path']} @ {m['commit']}")
    con.print(f"[bold]Held-out files are this machine's Python {m['python']} stdlib under the training rule; the "
              f"shipped pair was trained on Python 3.12's, so the file sets differ.[/]")
    hl = result["held_out_loss"]
    t = Table(title=f"1. held-out loss, offloaded runtime, {hl['dtype']} ({hl['windows']} of {hl['windows_available']} "
                    f"windows of {hl['window_tokens']} tokens)", title_justify="left")
    for c in ("files", "held-out files", "tokens", "loss (nats/token)"):
        t.add_column(c, justify="left" if c == "files" else "right")
    t.add_row("all", str(len(hl["per_file"])), str(hl["tokens"]), f"{hl['loss']:.3f}")
    for g, row in hl["groups"].items():
        t.add_row(g.replace("_", " "), str(row["files"]), str(row["tokens"]), "n/a" if row["loss"] is None else f"{row['loss']:.3f}")
    t.add_row("training record (3.12, bf16 / MXFP4)", "", "", result["training_record"]["held_out_loss"])
    con.print(t)

    ac = result["acceptance"]
    t = Table(title=f"2. acceptance, block {ac['block_size']}, greedy, {ac['prompts']} prompts", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    pp = ac["per_prompt"]
    t.add_row("acceptance length (pooled)", f"{ac['acceptance_length']:.3f} tokens per verify ({ac['verify_steps']} passes)")
    t.add_row("mean of per-prompt values", f"{ac['acceptance_length_prompt_mean']:.3f}")
    t.add_row("per prompt min / median / max", f"{pp['min']:.2f} / {pp['median']:.2f} / {pp['max']:.2f}")
    t.add_row("accepted by position", " ".join("n/a" if a is None else f"{a:.0%}" for a in ac["acceptance_per_position"]))
    t.add_row("lossless vs target greedy", f"{'yes' if ac['lossless'] else 'NO'} ({ac['runs_checked']} runs, "
                                           f"{len(ac['mismatches'])} mismatches)")
    rw = result.get("acceptance_random_windows")
    if rw:
        t.add_row(f"{rw['prompts']} random windows (record protocol)",
                  f"mean {rw['acceptance_length_prompt_mean']:.3f}, pooled {rw['acceptance_length']:.3f}, median {rw['median']:.2f}")
        t.add_row("training record (3.12, mean of 8)", f"{result['training_record']['held_out_acceptance_length']:.3f}")
    con.print(t)

    t = Table(title=f"3. route-ahead, cache {result['config']['cache_experts']} of {result['config']['total_experts']} "
                    "expert slots", title_justify="left")
    for c in ("predictor", "recall", "precision", "cache hit rate", "prefetch used / issued", "demand fetches"):
        t.add_column(c, justify="left" if c == "predictor" else "right")
    for name, row in result["route_ahead"].items():
        t.add_row(name, f"{row['recall']:.3f}", f"{row['precision']:.3f}", f"{row['cache_hit_rate']:.3f}",
                  f"{row['prefetch_used']} / {row['prefetch_issued']}", str(row["demand_fetches"]))
    con.print(t)

    cc = result["concentration"]
    t = Table(title=f"4. share of uses served by the most-used {cc['fraction']:.0%} of experts (uniform: {cc['fraction']:.0%})",
              title_justify="left")
    for c in ("unit", "uses", "overall", "uniform, same sample", "layer mean", "uniform, same sample ", "per layer"):
        t.add_column(c, justify="left" if c == "unit" else "right")
    for key in ("decode_per_token", "verify_per_pass"):
        r = cc[key]
        u = r["uniform_same_sample"]
        t.add_row(key.replace("_", " "), str(r["uses"]), f"{r['overall']:.3f}", f"{u['overall']:.3f}",
                  f"{r['layer_mean']:.3f}", f"{u['layer_mean']:.3f}", " ".join(f"{s:.2f}" for s in r["per_layer"]))
    con.print(t)

    bp = result.get("bench_priority")
    if bp is None:
        return
    if "error" in bp:
        con.print(f"[bold red]5. bench-priority failed[/] (exit {bp['returncode']}): {bp['error']}")
        return
    t = Table(title=f"5. {bp['command']}  ->  verdict {bp['verdict'].upper()}", title_justify="left")
    for c in ("arm", "exposed fetch ms (95% CI)", "ms per step", "tokens/s (95% CI)", "hit rate", "accept len"):
        t.add_column(c, justify="left" if c == "arm" else "right")

    def ci(x, scale=1.0, spec=".2f"):
        return "n/a" if x is None else f"{x['mean'] * scale:{spec}} [{x['lo'] * scale:{spec}}, {x['hi'] * scale:{spec}}]"

    for arm, a in bp["arms"].items():
        t.add_row(arm, ci(a["exposed_fetch_s"], 1e3), "n/a" if a["exposed_fetch_ms_per_step"] is None else f"{a['exposed_fetch_ms_per_step']:.2f}",
                  ci(a["tokens_per_second"]), "n/a" if a["hit_rate"] is None else f"{a['hit_rate']:.3f}",
                  "n/a" if a["acceptance_length"] is None else f"{a['acceptance_length']:.2f}")
    con.print(t)
    for r in bp["reasons"]:
        con.print(f"  {r}", markup=False)


def headline(result: dict) -> dict:
    """The exact numbers the summary rounds."""
    h = {
        "held_out_loss": result["held_out_loss"]["loss"],
        "held_out_loss_groups": {k: v["loss"] for k, v in result["held_out_loss"]["groups"].items()},
        "acceptance_length": result["acceptance"]["acceptance_length"],
        "acceptance_per_prompt_min_median_max": [result["acceptance"]["per_prompt"][k] for k in ("min", "median", "max")],
        "acceptance_length_prompt_mean": result["acceptance"]["acceptance_length_prompt_mean"],
        "acceptance_per_position": result["acceptance"]["acceptance_per_position"],
        "lossless": result["acceptance"]["lossless"],
        "route_ahead": {k: {"recall": v["recall"], "precision": v["precision"], "cache_hit_rate": v["cache_hit_rate"]}
                        for k, v in result["route_ahead"].items()},
        "top25_share": {k: {"overall": result["concentration"][k]["overall"],
                            "layer_mean": result["concentration"][k]["layer_mean"],
                            "uniform_same_sample_overall": result["concentration"][k]["uniform_same_sample"]["overall"]}
                        for k in ("decode_per_token", "verify_per_pass")},
    }
    rw = result.get("acceptance_random_windows")
    if rw:
        h["acceptance_random_windows"] = {k: rw[k] for k in ("acceptance_length", "acceptance_length_prompt_mean", "median")}
    bp = result.get("bench_priority")
    if bp and "error" not in bp:
        h["bench_priority"] = {"verdict": bp["verdict"],
                               "arms": {a: {"exposed_fetch_s": v["exposed_fetch_s"] and v["exposed_fetch_s"]["mean"],
                                            "tokens_per_second": v["tokens_per_second"] and v["tokens_per_second"]["mean"]}
                                        for a, v in bp["arms"].items()}}
    return h


# -- main ---------------------------------------------------------------------------------------
def measure(*, prompts: int, max_new_tokens: int, prefix_tokens: int, cache_experts: int, loss_windows: int | None,
            window_prompts: int = 0, predictors: tuple[str, ...] = PREDICTORS, log: Callable[[str], None] = _log) -> dict:
    """Measurements 1-4 on one loaded runtime (bench-priority is separate: :func:`run_bench_priority`)."""
    from pdflash.draft import load_draft
    from pdflash.offload.embedded import embedded_draft, embedded_target
    from pdflash.offload.runtime import OffloadedModel

    t_start = time.perf_counter()
    root, files = held_out_files()
    tok = load_tokenizer()
    stream, spans = encode_stream(tok, files)
    log(f"held-out: {len(files)} files of {root}, {stream.numel()} tokens")
    seconds = {}
    t0 = time.perf_counter()
    with OffloadedModel.load(embedded_target(), device="cpu", block_tokens=8) as rt:
        seconds["load"] = time.perf_counter() - t0
        fam = rt.family
        L, E, K = fam.num_layers, fam.num_experts, fam.top_k
        draft = load_draft(embedded_draft(), rt.model)
        rt.reset_cache(capacity_experts=L * E)
        rt.preload()
        loss = held_out_loss(rt, stream, spans, max_windows=loss_windows)
        seconds["held_out_loss"] = loss["seconds"]
        log(f"held-out loss {loss['loss']:.4f} nats over {loss['tokens']} tokens ({loss['seconds']:.0f} s)")
        chosen = prompt_prefixes(tok, files, prompts, prefix_tokens)
        t0 = time.perf_counter()
        gen = run_generations(rt, draft, chosen, max_new_tokens, cache_experts=cache_experts, predictors=predictors, log=log)
        seconds["generations"] = time.perf_counter() - t0
        windows = None
        if window_prompts:
            t0 = time.perf_counter()
            rt.reset_cache(capacity_experts=L * E)
            windows = acceptance_on_windows(rt, draft, stream, window_prompts, max_new_tokens=max_new_tokens)
            seconds["window_prompts"] = time.perf_counter() - t0
    record = json.loads((embedded_target() / "training.json").read_text())
    seconds["measure_total"] = time.perf_counter() - t_start
    return {
        "schema": SCHEMA,
        "machine": machine_info(root),
        "config": {"prompts": prompts, "max_new_tokens": max_new_tokens, "prefix_tokens": prefix_tokens,
                   "cache_experts": cache_experts, "total_experts": L * E, "layers": L, "experts": E, "top_k": K,
                   "block_size": draft.config.block_size, "predictors": list(predictors), "lookahead_depth": 2,
                   "loss_windows": loss_windows, "window_prompts": window_prompts},
        "training_record": {
            "corpus": record["corpus"]["source"],
            "held_out_loss": f"{record['target']['held_out_loss_bf16']:.3f} / {record['target']['held_out_loss_mxfp4']:.3f}",
            "held_out_loss_bf16": record["target"]["held_out_loss_bf16"],
            "held_out_loss_mxfp4": record["target"]["held_out_loss_mxfp4"],
            "held_out_files": record["corpus"]["held_out_files"],
            "held_out_acceptance_length": record["draft"].get("held_out_acceptance_length"),
        },
        "held_out_loss": loss,
        "prompts": [{"file": name, "tokens": len(ids)} for name, ids in chosen],
        "acceptance": acceptance_summary(gen, predictors[0]),
        "acceptance_random_windows": windows,
        "route_ahead": route_ahead_summary(gen),
        "concentration": concentration_summary(gen, L, E, K),
        "generations": gen["prompts"],
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON result")
    ap.add_argument("--prompts", type=int, default=12, help="held-out files whose prefixes are the prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt and run")
    ap.add_argument("--prefix-tokens", type=int, default=64, help="prompt length in tokens")
    ap.add_argument("--cache-experts", type=int, default=64, help="expert cache slots of the generation runs")
    ap.add_argument("--loss-windows", type=int, default=256, help="most windows of the held-out loss (0: all)")
    ap.add_argument("--window-prompts", type=int, default=8,
                    help="random held-out windows for the training record's acceptance protocol (0: skip)")
    ap.add_argument("--bench-priority", action=argparse.BooleanOptionalAction, default=True,
                    help="also run pdflash bench-priority --link-gbps 0.2 (about 2 minutes)")
    ap.add_argument("--link-gbps", type=float, default=0.2, help="simulated link of the bench-priority run")
    args = ap.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 2 or args.prefix_tokens < 1:
        ap.error("--prompts and --prefix-tokens must be at least 1, --max-new-tokens at least 2")
    if not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: the directory {args.out.parent} does not exist")
    _import_pdflash()

    t0 = time.perf_counter()
    result = measure(prompts=args.prompts, max_new_tokens=args.max_new_tokens, prefix_tokens=args.prefix_tokens,
                     cache_experts=args.cache_experts, loss_windows=args.loss_windows or None,
                     window_prompts=args.window_prompts)
    if args.bench_priority:
        result["bench_priority"] = run_bench_priority(args.out.parent / "bm3-embedded.json", args.link_gbps)
        result["seconds"]["bench_priority"] = result["bench_priority"]["wall_seconds"]
    result["seconds"]["total"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["headline"] = headline(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print("exact numbers (all of them in " + str(args.out) + "):")
    print(json.dumps(result["headline"], indent=2))
    _log(f"done in {result['seconds']['total']:.0f} s -> {args.out}")
    bp = result.get("bench_priority")
    if bp is not None and "error" in bp:
        sys.exit(1)


if __name__ == "__main__":
    main()
