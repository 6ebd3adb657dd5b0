"""`pdflash generate`: generate text with a model whose experts are offloaded.

The command is assembled from small steps so new modes plug in without touching
the rest: ``_read_prompt`` -> ``_load_options`` (kwargs of OffloadedModel.load)
-> ``_encode`` -> ``_run`` (the decoding loop; returns the result and extra JSON
fields) -> ``_report`` (the JSON object) / ``_print_summary``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pdflash import GenerationInterrupted, Interrupted, PdflashError

DEFAULT_DEVICE = "auto"


def _check_trace(path: Path | None) -> None:
    """Refuse, before anything loads, a --trace path that cannot be written, without touching the
    file: a run that then fails (a wrong --model, a prompt too long) leaves an earlier trace as it was."""
    if path is None:
        return
    if path.is_dir():
        raise PdflashError(f"--trace {path} is a directory: give a file path, e.g. {path / 'trace.jsonl'}", exit_code=2)
    parent = path.parent
    if not parent.is_dir():
        reason = f"no such directory {parent}"
    elif not os.access(path if path.exists() else parent, os.W_OK):
        reason = "permission denied"
    else:
        return
    raise PdflashError(f"cannot write --trace {path}: {reason}; give a writable file path", exit_code=2)


def _open_trace(path: Path | None):
    """The --trace file, opened (truncated) for writing when decoding starts; None without --trace."""
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise PdflashError(f"cannot write --trace {path}: {exc.strerror or exc}; give a writable file path",
                           exit_code=2) from None


def _trace_line(f, row: dict) -> None:
    f.write(json.dumps(row) + "\n")


def _read_prompt(prompt: str) -> str:
    """The prompt text: the argument, or stdin for '-'; it must be UTF-8 and not blank."""
    if prompt == "-":
        raw = getattr(sys.stdin, "buffer", None)
        if raw is not None:
            data = raw.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PdflashError(f"the prompt on stdin is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                                   f"{exc.start}): convert it to UTF-8, e.g. with iconv") from None
        else:
            text = sys.stdin.read()
    else:
        text = prompt
        try:  # bytes that are not UTF-8 reach Python as lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PdflashError(f"the prompt argument is not UTF-8 text (character {exc.start} is an undecodable "
                               "byte): give UTF-8 text, or '-' to read UTF-8 from stdin") from None
    if not text.strip():
        raise PdflashError("the prompt is empty: give some text (or '-' to read it from stdin)")
    return text


def _check_options(*, expert_cache_mib, expert_cache_experts, device, dtype, temperature, seed, link_gbps,
                   eviction, block_size, cpu_threads=None) -> None:
    """Option values that are wrong by themselves: bad usage (exit 2), before anything is read."""
    from pdflash.cli import checks
    from pdflash.offload.cache import EVICTION_POLICIES
    from pdflash.offload.runtime import DTYPES

    checks.finite("--expert-cache-mib", expert_cache_mib, low=0)
    checks.at_least("--expert-cache-experts", expert_cache_experts, 0)
    if expert_cache_mib is not None and expert_cache_experts is not None:
        raise checks.usage("give --expert-cache-mib or --expert-cache-experts, not both")
    checks.device(device)
    checks.choice("--dtype", dtype, ("auto", *DTYPES))
    checks.finite("--temperature", temperature, low=0)
    checks.seed(seed)
    checks.link_gbps(link_gbps)
    checks.choice("--eviction", eviction, EVICTION_POLICIES)
    checks.cpu_threads(cpu_threads)
    from pdflash.draft.offloaded import parse_block_size

    block = parse_block_size(block_size)  # "auto" or a whole number (else bad usage)
    if isinstance(block, int):
        checks.at_least("--block-size", block, 1)


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _load_options(
    *,
    device: str,
    dtype: str,
    expert_cache_mib: float | None,
    expert_cache_experts: int | None,
    link_gbps: float | None,
    eviction: str,
    lookahead_depth: int,
    history_depth: int,
    show_progress: bool,
    cpu_experts: str | None = None,
    cpu_threads: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of OffloadedModel.load for these command-line options.

    ``--cpu-experts auto`` (the default) on the CPU device computes every expert natively from
    host memory, unless the run is an offload experiment (a cache size or a simulated link is
    given): then the experts go through the cache as on a GPU. On CUDA, auto's guard keeps the
    fastest of fetch-only, every expert on the CPU and the split placements, measured on the
    run's own decode steps and verify blocks (offload/cpu_compute.py, HybridGuard); where every expert fits in
    the cache it is off."""
    dev = _resolve_device(device)
    if cpu_experts is None:
        cpu_experts = "auto"
    if cpu_experts == "auto" and dev == "cpu" and (
        link_gbps is not None or expert_cache_mib is not None or expert_cache_experts is not None
    ):
        cpu_experts = "off"
    opts = dict(
        device=dev,
        dtype=None if dtype == "auto" else dtype,
        expert_cache_mib=expert_cache_mib,
        expert_cache_experts=expert_cache_experts,
        link_gbps=link_gbps,
        eviction=eviction,
        lookahead_depth=lookahead_depth,
        history_depth=history_depth,
        progress=show_progress,
        cpu_experts=cpu_experts,
        cpu_threads=cpu_threads,
    )
    # every expert fits: copy them in while loading, so generation starts warm
    opts["preload"] = expert_cache_mib is None and expert_cache_experts is None
    return opts


def _encode(rt, text: str, chat: bool) -> list[int]:
    tok = rt.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise PdflashError(f"--chat: the tokenizer of {rt.path} has no chat template; run without --chat")
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, verbose=False).input_ids
    else:
        ids = tok(text, verbose=False).input_ids  # a prompt too long for the context is reported below
    if not ids:
        raise PdflashError("the prompt encodes to no tokens")
    vocab = int(rt.config.vocab_size)
    if max(ids) >= vocab:
        raise PdflashError(f"the tokenizer produced id {max(ids)} but the model has only {vocab} embeddings")
    return list(ids)


def _run(rt, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int, on_step,
         spec: dict | None = None, on_verify=None, cuda_graphs: bool = False) -> tuple[Any, dict]:
    """Decode; returns (GenerationResult, extra fields for the JSON report).

    ``spec`` (from pdflash.draft.speculative_options) switches to speculative decoding with a
    DFlash draft; its extra fields are acceptance_length, draft_ms, verify_ms, route_ahead, ...
    """
    from pdflash.offload.generate import generate as run_generate

    if spec is not None:
        from pdflash.draft import generate_with_draft

        res, extra = generate_with_draft(rt, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                         on_step=on_step, on_verify=on_verify, graphs=cuda_graphs, **spec)
        return res, {"cuda_graphs": cuda_graphs, **extra}

    res = run_generate(rt, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, on_step=on_step,
                       cuda_graphs=cuda_graphs)
    return res, {"cuda_graphs": cuda_graphs}


def _report(rt, res, text: str, extra: dict, load_s: float) -> dict:
    st = res.stats
    return {
        "token_ids": res.token_ids,
        "text": text,
        "prompt_tokens": res.prompt_tokens,
        "generated_tokens": len(res.token_ids),
        "stop_reason": res.stop_reason,
        "tokens_per_second": res.tokens_per_second,
        "ttft_ms": res.ttft_ms,
        "tpot_ms": res.tpot_ms,
        "load_seconds": load_s,
        "exposed_fetch_seconds": st["exposed_fetch_seconds"],
        "exposed_fetch_by_band": st["exposed_fetch_by_band"],
        "cache": st["cache"],
        "prefetch": st["prefetch"],
        "bytes_moved": st["bytes_moved"],
        "bytes_per_token": st["bytes_per_token"],
        "link_busy_seconds": st["link_busy_seconds"],
        "link_gbps": st["link_gbps"],
        "link_emulated": st["link_emulated"],
        "cpu_experts": st["cpu_experts"],
        "experts_per_token": st["experts_per_token"],
        "bands": [
            {k: b[k] for k in ("band", "name", "submitted", "completed", "cancelled", "promoted", "stall_seconds",
                               "queue_wait_seconds", "bytes")}
            for b in st["bands"]
        ],
        "model": str(rt.path),
        "device": st["device"],
        "dtype": st["dtype"],
        "expert_format": st["expert_format"],
        "per_layer": st["per_layer"],
        **extra,
    }


def _report_interrupted(rt, token_ids: list[int], prompt_tokens: int, max_new_tokens: int, json_out: bool) -> None:
    """Ctrl-C during generation: print the tokens generated so far (text, or one JSON object
    marked interrupted), then raise Interrupted (exit 130, one line on stderr)."""
    text = rt.tokenizer.decode(token_ids)
    if json_out:
        print(json.dumps({
            "interrupted": True,
            "token_ids": token_ids,
            "text": text,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": len(token_ids),
            "max_new_tokens": max_new_tokens,
            "stop_reason": "interrupted",
            "model": str(rt.path),
            "device": str(rt.device),
        }))
    else:
        print(text, flush=True)
    where = "in the JSON object on stdout" if json_out else "on stdout"
    raise Interrupted(f"stopped by Ctrl-C after {len(token_ids)} of {max_new_tokens} tokens; the text so far is {where}")


def _fmt(v, unit: str = "", digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _print_summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    print(report["text"])
    c = report["cache"]
    t = Table(title="generation", title_justify="left", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("tokens", f"{report['generated_tokens']} ({report['stop_reason']})"),
        ("tokens/s (decode)", _fmt(report["tokens_per_second"])),
        ("time to first token", _fmt(report["ttft_ms"], " ms", 1)),
        ("time per output token", _fmt(report["tpot_ms"], " ms", 1)),
        ("exposed fetch", _fmt(report["exposed_fetch_seconds"], " s", 4)),
        ("cache hit rate", "n/a" if c["hit_rate"] is None else f"{c['hit_rate']:.1%} ({c['hits']} hits, {c['misses']} misses)"),
        ("cache", f"{c['slots']} slots of {_size(c['slot_bytes'])}, {c['resident']} resident, {c['policy']} eviction"),
        ("bytes moved", f"{report['bytes_moved'] / 1e6:.2f} MB"),
        ("link busy", _fmt(report["link_busy_seconds"], " s", 4)),
    ]
    if report.get("link_emulated"):
        rows.append(("emulated link", f"{report['link_gbps']:g} GB/s (real copies paced to this rate)"))
    ce, ept = report["cpu_experts"], report["experts_per_token"]
    if ce["mode"] != "off":
        per = lambda k: _fmt(ept[k])  # noqa: E731
        rows += [
            ("experts/token: cache, fetched, cpu", f"{per('cache')}, {per('fetched')}, {per('cpu')}"),
            ("cpu experts", f"{ce['mode']}: {ce['computed']} computed in {_fmt(ce['seconds'], ' s', 3)} "
                            f"({_threads_text(ce)}, {ce.get('level')})"
                            + (f"; {ce['host_steps']} host steps (one CUDA graph each)" if ce.get("host_steps") else "")),
        ]
        for mode, tl in (ce.get("host_timeline_ms") or {}).items():
            rows.append((f"host steps ({mode}), ms each", _timeline_text(tl)))
        ra = ce.get("route_ahead") or {}
        if ra.get("sent"):
            rows.append(("route-ahead (split steps)", f"{ra['sent']} next-layer prefetches, {ra['used']} used, "
                                                      f"{ra['cancelled']} cancelled"))
        if ce.get("guard"):
            rows.append(("hybrid guard", _guard_text(ce["guard"])))
    elif ce.get("reason_off"):
        rows.append(("cpu experts", f"off: {ce['reason_off']}"))
    if "acceptance_length" in report:
        rows += _speculative_rows(report)
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


def _live_timeline(fs) -> str:
    """The live table's view of the host steps so far: mean ms per step inside the host nodes
    and between them (every mode together)."""
    node, gaps = fs.host_step_mean_s("node"), fs.host_step_mean_s("gaps")
    if node is None:
        return ""
    return f" ({1e3 * node:.1f} ms in nodes, {1e3 * gaps:.1f} between, per step)"


def _threads_text(ce: dict) -> str:
    """The kernel's threads, and how many work beside fetches where that is fewer."""
    n, fetching = ce.get("threads"), ce.get("fetch_threads")
    return f"{n} threads" + (f", {fetching} beside fetches" if fetching is not None and fetching != n else "")


def _timeline_text(tl: dict) -> str:
    """One mode's host-step timeline (mean ms per step): where a step's wall time went."""
    return (f"{tl['step']:.2f} over {tl['steps']} steps: host nodes {tl['node']:.2f} (CPU kernel {tl['kernel']:.2f}, "
            f"fetch wait {tl['fetch_wait']:.2f}), device between nodes {tl['gaps']:.2f}, "
            f"launch and end {tl['head'] + tl['tail']:.2f}"
            + (f"; bookkeeping after it {tl['bookkeeping']:.2f}" if "bookkeeping" in tl else ""))


def _guard_text(guard: dict) -> str:
    """auto's guard: the arm it keeps and the last median decode step of each arm it measured."""
    ms = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in guard.items() if k.endswith("_ms") and v is not None)
    if not guard.get("checks"):
        return f"{guard['arm']} (no check completed yet: it needs about 16 decode steps or verify blocks)"
    return f"kept {guard['arm']} after {guard['checks']} check(s); ms per decode step: {ms}"


def _planner_rows(planner: dict | None) -> list[tuple[str, str]]:
    if not planner or planner["predicted_step_ms"] is None:
        return []
    unit = "ms" if planner["step_clock"] == "wall" else f"ms of {planner['step_clock']}"
    return [("step time predicted / measured",
             f"{planner['predicted_step_ms']:.1f} / {planner['measured_step_ms']:.1f} {unit} "
             f"(mean abs error {planner['step_time_abs_error_ms']:.1f} ms, {planner['predicted_steps']} steps)"),
            ("planner probes", f"{planner['probes']} ({planner['shadow_probes']} in shadow: drafted, not verified)"),
            *_fetch_prediction_rows(planner.get("fetch_prediction"))]


def _fetch_prediction_rows(fp: dict | None) -> list[tuple[str, str]]:
    """Which prediction priced the blocks' fetches, with both recent errors (experts per step)."""
    if not fp or fp["route_error"] is None or fp["mean_error"] is None:
        return []
    name = {"mean": "recent mean", "route": "route-ahead"}
    return [("fetch priced by", f"{name[fp['in_use']]} (recent error: route-ahead {fp['route_error']:.1f}, "
                                f"recent mean {fp['mean_error']:.1f} experts per step)")]


def _moved(rt) -> float:
    return float(sum(lv["bytes"] for lv in rt.scheduler.stats()["levels"]))


def _histogram_text(hist: dict) -> str:
    return " ".join(f"{b}:{n}" for b, n in sorted(hist.items(), key=lambda kv: int(kv[0])))


def _speculative_rows(report: dict) -> list[tuple[str, str]]:
    ra = report["route_ahead"]
    rows = []
    if "oracle_acceptance" in report:
        rows.append(("ORACLE ACCEPTANCE", f"P = {report['oracle_acceptance']}: draft proposals replaced by the target's greedy tokens"))
    bpt = report.get("bytes_per_committed_token")
    rows += [
        ("block size", f"{report['block_size']} (up to {report['max_block_size']})"
                       + (f"; every verify pass runs {report['verify_rows']} rows (batch-invariant)" if report.get("verify_rows") else "")
                       + ("; verify blocks checked to round as single steps: no fixed rows"
                          if report.get("verify_rows_check") == "agree" else "")),
        ("blocks (B:steps)", _histogram_text(report["block_histogram"])),
        ("bytes / committed token", "n/a" if bpt is None else f"{bpt / 1e6:.2f} MB"),
        ("acceptance length", f"{report['acceptance_length']:.2f} tokens per verify ({report['verify_steps']} verify passes)"),
        ("acceptance per position", " ".join(f"{a:.0%}" for a in report["acceptance_per_position"]) or "n/a"),
        ("draft / verify", f"{report['draft_ms']:.1f} ms / {report['verify_ms']:.1f} ms"),
        *_planner_rows(report.get("planner")),
        ("route-ahead", "off" if ra is None else
         f"{ra['predictor']}: recall {ra['recall']:.1%}, precision {ra['precision']:.1%}, wasted {ra['wasted_bytes'] / 1e6:.2f} MB"),
    ]
    return rows


def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text; '-' reads it from stdin.")],
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory: config.json, safetensors weights and tokenizer. Default: the embedded stdlib-moe model (with its draft).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate (generation also stops at an end-of-sequence token).")] = 64,
    expert_cache_mib: Annotated[float | None, typer.Option(help="Device memory for the expert cache in MiB; default: every expert resident.")] = None,
    expert_cache_experts: Annotated[int | None, typer.Option(help="Expert cache size as a number of experts (instead of --expert-cache-mib).")] = None,
    device: Annotated[str, typer.Option(help="Where to compute: cpu, cuda, cuda:N, or auto (cuda when available).")] = DEFAULT_DEVICE,
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto (the checkpoint's), bfloat16, float16 or float32.")] = "auto",
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 means greedy decoding.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the sampler (used when --temperature is above 0).")] = 0,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Show the live table of fetch bands on stderr (terminals only).")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with the tokens, text, timing and fetch statistics.")] = False,
    link_gbps: Annotated[float | None, typer.Option(help="Host-to-device link rate in GB/s. On the CPU: simulate a link of this speed, so offloading costs real time. On CUDA: pace the real copies to this rate, emulating a slower PCIe link (e.g. 25 for PCIe 4.0 x16).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the tokenizer's chat template as a user message.")] = False,
    eviction: Annotated[str, typer.Option(help="Expert cache eviction policy: balanced (from a layer over an equal share of the slots, else the one whose layer comes back last: keeps part of every layer when a verify block touches more experts than the cache holds), lru, lfu (frequency with decay) or lookahead (spare predicted experts).")] = "balanced",
    lookahead_depth: Annotated[int, typer.Option(min=0, help="Prefetch by applying the routers of the next N layers to the current hidden state (0: off).")] = 0,
    history_depth: Annotated[int, typer.Option(min=0, help="Prefetch the most used experts of the next N layers in the background band (0: off).")] = 0,
    draft: Annotated[Path | None, typer.Option(help="DFlash draft checkpoint directory: decode speculatively (greedy output stays identical).")] = None,
    block_size: Annotated[str | None, typer.Option(help="With --draft: tokens per verify pass, auto (default: chosen each step by the block planner, 1 = plain decoding) or a fixed N from 1 up to the draft's trained block size.")] = None,
    route_ahead_predictor: Annotated[str, typer.Option(help="With --draft: how to predict the experts of each verify pass for prefetch: draft-router, previous, lookahead, a '+'-joined union, or none (the default: the prefetch measured slower than none under the block planner, docs/benchmarks.md).")] = "none",  # = draft.offloaded.DEFAULT_PREDICTOR (not imported here: the CLI starts light)
    draft_acceptance: Annotated[float | None, typer.Option(help="With --draft: oracle-acceptance benchmark mode; the draft still runs but its proposals become the target's greedy tokens with mismatches at rate 1-P.")] = None,
    prompt_lookup: Annotated[bool, typer.Option("--prompt-lookup/--no-prompt-lookup", help="With a draft, greedy: when the last 3 tokens occurred earlier, what followed them then leads the verify block where the draft proposes otherwise (output unchanged).")] = True,
    batch_invariant: Annotated[bool | None, typer.Option("--batch-invariant/--no-batch-invariant", help="With a draft: run every verify pass with the draft's trained block length of rows, so a token's logits do not depend on the block it was verified in (output identical to plain decoding through the same rows, also in bf16). Default: in --draft-acceptance mode in a 16-bit dtype, on where a check at the start finds this machine's verify blocks rounding apart from single-token steps; off otherwise.", show_default=False)] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Decode without a draft, also with the embedded default model.")] = False,
    cpu_experts: Annotated[str | None, typer.Option(help="Experts computed on the CPU by the native kernel from host memory: auto (on CUDA: decode steps and verify blocks try fetch-only, every routed expert on the CPU, the cost model's per-layer split and every missing expert on the CPU, and keep the fastest; on the CPU device: all, unless a cache size or --link-gbps is given), off, or all (every expert on the CPU: the fastest on a host whose DRAM outruns its link). Default: auto.", show_default=False)] = None,
    cpu_threads: Annotated[int | None, typer.Option(min=1, help="Threads of the native CPU expert kernel (default: the cores this process may use; beside a GPU every core but two, and while fetches may run one fewer per copy worker).")] = None,
    cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", help="Replay each layer's non-expert part as a CUDA graph, for plain steps and every verify block length, and the draft's passes (default: on CUDA, off elsewhere).", show_default=False)] = None,
    trace: Annotated[Path | None, typer.Option(help="Write one JSON line per decode step to this file: its wall time since the previous step ended (step_ms), and with a draft the block length, acceptance, draft and verify time and the planner's prediction. Overwrites the file.")] = None,
) -> None:
    """Generate text; the experts stay in host memory and are fetched into a device cache on demand.

    Examples:
      pdflash generate "def fibonacci(n):"          # embedded model + draft, CPU is enough
      pdflash generate "The capital of France is" --model ./gpt-oss-20b --expert-cache-mib 4096
      echo "Hello" | pdflash generate - --model /tmp/tiny --device cpu --link-gbps 8 --json
      pdflash generate "Hello" --model /tmp/tiny --draft /tmp/tiny/draft --block-size 3 --expert-cache-experts 8
    """
    from pdflash.cli.live import LiveBandTable, live_enabled
    from pdflash.draft import speculative_options
    from pdflash.offload.prompt import check_context
    from pdflash.offload.runtime import OffloadedModel

    _check_options(expert_cache_mib=expert_cache_mib, expert_cache_experts=expert_cache_experts, device=device,
                   dtype=dtype, temperature=temperature, seed=seed, link_gbps=link_gbps, eviction=eviction,
                   block_size=block_size, cpu_threads=cpu_threads)
    if no_draft and draft is not None:
        raise PdflashError("--draft and --no-draft contradict each other; give one", exit_code=2)
    if model is None:
        from pdflash.offload.embedded import embedded_draft, embedded_target

        model = embedded_target()
        if draft is None and not no_draft:
            draft = embedded_draft()
    if cuda_graphs and device not in ("cuda", "auto") and not str(device).startswith("cuda:"):
        raise PdflashError("--cuda-graphs needs --device cuda", exit_code=2)
    spec = speculative_options(draft, block_size=block_size, predictor=route_ahead_predictor,
                               acceptance=draft_acceptance, temperature=temperature, lookup=prompt_lookup,
                               batch_invariant=batch_invariant)
    text = _read_prompt(prompt)
    _check_trace(trace)
    draw = live_enabled(live, json_out)
    opts = _load_options(
        device=device, dtype=dtype, expert_cache_mib=expert_cache_mib, expert_cache_experts=expert_cache_experts,
        link_gbps=link_gbps, eviction=eviction, lookahead_depth=lookahead_depth, history_depth=history_depth,
        show_progress=draw, cpu_experts=cpu_experts, cpu_threads=cpu_threads,
    )
    if spec is not None:
        opts["block_tokens"] = spec["block_size"]  # the cache minimum covers one verify block
        if spec["acceptance"] is not None:
            print(f"oracle-acceptance mode: the draft's proposals are replaced by the target's greedy tokens "
                  f"with mismatches at rate {1 - spec['acceptance']:.2f}; acceptance figures are synthetic", file=sys.stderr)
    t0 = time.perf_counter()
    with OffloadedModel.load(model, **opts) as rt:
        load_s = time.perf_counter() - t0
        ids = _encode(rt, text, chat)
        check_context(rt.config, len(ids), max_new_tokens)  # before any forward
        if cuda_graphs is None:  # default: on CUDA (plain steps and every verify block length)
            cuda_graphs = rt.device.type == "cuda"
        rate: dict[str, Any] = {"n": 0, "tps": None}

        last_end = [None]  # when the previous decode step ended (perf_counter), for --trace

        def step_ms() -> float | None:
            now = time.perf_counter()
            ms = None if last_end[0] is None else round(1e3 * (now - last_end[0]), 3)
            last_end[0] = now
            return ms

        def on_step(step) -> None:
            rate["n"] = step.index + 1
            rate["tps"] = step.tokens_per_second
            if trace_file is not None and spec is None:  # plain decoding: one line per token
                _trace_line(trace_file, {"step": step.index, "token": step.token_id, "step_ms": step_ms()})

        def on_verify(step) -> None:  # speculative decoding: one call per verify pass
            if trace_file is not None:
                _trace_line(trace_file, {
                    "step": step.step, "block": step.block_size, "accepted": step.accepted,
                    "committed": len(step.committed), "shadow": step.shadow_block, "step_ms": step_ms(),
                    "draft_ms": round(1e3 * step.draft_seconds, 3), "verify_ms": round(1e3 * step.verify_seconds, 3),
                    "predicted_ms": None if step.predicted_seconds is None else round(1e3 * step.predicted_seconds, 3)})
            rate["verifies"] = rate.get("verifies", 0) + 1
            rate["committed"] = rate.get("committed", 0) + len(step.committed)
            rate["prefetched"] = step.route_ahead_submitted
            hist = rate.setdefault("blocks", {})
            hist[step.block_size] = hist.get(step.block_size, 0) + 1
            rate["shadow"] = rate.get("shadow", 0) + (1 if step.shadow_block else 0)
            if step.predicted_seconds is not None:
                rate["predicted_s"] = rate.get("predicted_s", 0.0) + step.predicted_seconds
                rate["measured_s"] = rate.get("measured_s", 0.0) + step.planner_measured_seconds
            if "bytes0" not in rate:  # from the end of the first verify pass (prefill excluded)
                rate["bytes0"], rate["committed0"] = _moved(rt), rate["committed"]

        def status() -> list[tuple[str, str]]:
            hr = rt.cache.stats.hit_rate()
            fields = [
                ("tokens", str(rate["n"])),
                ("tok/s", _fmt(rate["tps"], "", 1)),
                ("hit rate", "n/a" if hr is None else f"{hr:.1%}"),
                ("exposed fetch", f"{rt.cache.stats.exposed_s:.3f} s"),
            ]
            if rt.cpu_mode != "off":
                fs = rt.cache.stats
                per = (lambda n: f"{n / fs.tokens:.2f}") if fs.tokens else (lambda n: "n/a")  # noqa: E731
                fields += [("experts/token cache|fetched|cpu", f"{per(fs.hits)}|{per(fs.misses)}|{per(fs.cpu)}"),
                           ("cpu time", f"{fs.cpu_seconds:.3f} s"),
                           ("host steps", str(fs.host_steps) + _live_timeline(fs)),
                           ("link busy", f"{rt.scheduler.stats()['link_busy_s']:.3f} s")]
            if rate.get("verifies"):
                fields += [("accept len", f"{rate['committed'] / rate['verifies']:.2f}"),
                           ("route-ahead this step", str(rate["prefetched"])),
                           ("blocks (B:steps)", _histogram_text(rate["blocks"])
                            + (f", {rate['shadow']} shadow probes" if rate["shadow"] else "")),
                           ("MB / committed tok", "n/a" if rate["committed"] == rate["committed0"] else
                            f"{(_moved(rt) - rate['bytes0']) / (rate['committed'] - rate['committed0']) / 1e6:.2f}")]
                if rate.get("measured_s"):
                    fields.append(("planned step ms predicted / measured",
                                   f"{1e3 * rate['predicted_s'] / rate['verifies']:.1f} / {1e3 * rate['measured_s'] / rate['verifies']:.1f}"))
            if spec is not None and spec["acceptance"] is not None:
                fields.append(("ORACLE", f"P={spec['acceptance']}"))
            return fields

        trace_file = _open_trace(trace)
        try:
            with LiveBandTable(rt.scheduler, status=status, enabled=draw):
                res, extra = _run(rt, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  on_step=on_step, spec=spec, on_verify=on_verify, cuda_graphs=cuda_graphs)
        except GenerationInterrupted as stop:
            _report_interrupted(rt, stop.token_ids, len(ids), max_new_tokens, json_out)
        finally:
            if trace_file is not None:
                trace_file.close()
        out_text = rt.tokenizer.decode(res.token_ids)
        report = _report(rt, res, out_text, extra, load_s)
    if json_out:
        print(json.dumps(report))
    else:
        _print_summary(report)
