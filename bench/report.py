"""Output of ``bench-priority``: the JSON file, a Rich table and the PNG figure.

Every number comes from the result dict of :func:`pdflash.bench.priority.run_priority_bench`;
a metric that was not measured (``None``) is shown as "n/a" and never drawn as 0.
matplotlib is imported only when the figure is drawn (Agg backend, no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path

from pdflash import PdflashError

BAND_LABELS = {0: "0 on-demand", 1: "1 route-ahead", 2: "2 background"}
BAND_COLORS = {0: "#d62728", 1: "#1f77b4", 2: "#7f7f7f"}
ARM_COLORS = {"flat": "#7f7f7f", "banded": "#1f77b4", "on-demand": "#d62728", "resident": "#2ca02c", "oracle": "#9467bd"}
VERDICT_STYLE = {"ship": "bold green", "no-ship": "bold red", "inconclusive": "bold yellow", "unmeasurable": "bold magenta"}


def fmt(v, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, spec)


def fmt_interval(iv: dict | None, spec: str = ".2f", scale: float = 1.0) -> str:
    """'mean [lo, hi]' of a summary interval, 'n/a' when not measured."""
    if not iv or iv.get("mean") is None:
        return "n/a"
    s = f"{iv['mean'] * scale:{spec}} [{iv['lo'] * scale:{spec}}, {iv['hi'] * scale:{spec}}]"
    if iv.get("missing"):
        s += f" ({iv['missing']} n/a)"
    return s


# -- JSON ---------------------------------------------------------------------------------------
def write_json(result: dict, path: Path) -> None:
    try:
        path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    except OSError as exc:
        raise PdflashError(f"could not write {path}: {exc.strerror or exc}") from None


# -- terminal -----------------------------------------------------------------------------------
def print_report(result: dict, console) -> None:
    """Tables (per-arm metrics, bands, paired differences, peers) and the verdict."""
    from rich.panel import Panel
    from rich.table import Table

    cfg, setup, summary = result["config"], result["setup"], result["summary"]
    mode = (f"oracle-acceptance P = {cfg['draft_acceptance']}" if cfg["draft_acceptance"] is not None
            else "the draft's own proposals")
    title = (f"bench-priority: {len(cfg['arms'])} arms x {cfg['repetitions']} repetitions x "
             f"{len(setup['prompt_tokens'])} prompts, {cfg['max_new_tokens']} tokens, block {setup.get('block_mode') or setup['block_size']} (max {setup['block_size']}), "
             f"cache {setup['budget_experts']}/{setup['total_experts']} experts, {mode}")
    t = Table(title=title, title_justify="left")
    for col in ("arm", "exposed fetch ms (95% CI)", "per step ms", "tokens/s (95% CI)", "TPOT ms", "accept len",
                "hit rate", "MB moved", "on-demand stall/fetch us"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for arm in cfg["arms"]:
        m = summary[arm]
        t.add_row(
            arm, fmt_interval(m["exposed_fetch_s"], ".2f", 1e3), fmt(m["exposed_fetch_ms_per_step"]["mean"]),
            fmt_interval(m["tokens_per_second"]), fmt(m["tpot_ms"]["mean"]), fmt(m["acceptance_length"]["mean"]),
            fmt(m["hit_rate"]["mean"], ".3f"), fmt(m["bytes_moved"]["mean"], ".2f", 1e-6),
            fmt(m["on_demand_stall_per_fetch_s"]["mean"], ".1f", 1e6),
        )
    console.print(t)

    pl = Table(title="Verify blocks: lengths chosen (B:steps, summed over runs), bytes per committed token, "
                     "planner step time predicted / measured (mean per run)", title_justify="left")
    for col in ("arm", "blocks", "MB / committed token", "step ms predicted / measured", "abs error ms"):
        pl.add_column(col, justify="left" if col in ("arm", "blocks") else "right")
    for arm in cfg["arms"]:
        m = summary[arm]
        hist = m.get("block_histogram") or {}
        pl.add_row(arm, " ".join(f"{b}:{n}" for b, n in hist.items()) or "-",
                   fmt(m["bytes_per_committed_token"]["mean"], ".2f", 1e-6),
                   f"{fmt(m['planner_predicted_step_ms']['mean'])} / {fmt(m['planner_measured_step_ms']['mean'])}",
                   fmt(m["planner_abs_error_ms"]["mean"]))
    console.print(pl)

    bt = Table(title="Scheduler bands in the decode window (mean per run): stall / queue wait ms, MB moved",
               title_justify="left")
    bt.add_column("arm")
    for band in ("on-demand", "route-ahead", "background"):
        bt.add_column(band, justify="right")
    for arm in cfg["arms"]:
        m = summary[arm]
        cells = []
        for band in ("on-demand", "route-ahead", "background"):
            cells.append(f"{fmt(m[f'band.{band}.stall_s']['mean'], '.2f', 1e3)} / "
                         f"{fmt(m[f'band.{band}.queue_wait_s']['mean'], '.2f', 1e3)} / "
                         f"{fmt(m[f'band.{band}.bytes']['mean'], '.2f', 1e-6)}")
        bt.add_row(arm, *cells)
    console.print(bt)

    if result.get("paired"):
        pt = Table(title="Paired differences (same repetition and prompt), mean [95% CI]", title_justify="left")
        for col in ("pair", "exposed fetch ms", "tokens/s", "on-demand stall/fetch us", "hit rate"):
            pt.add_column(col, justify="left" if col == "pair" else "right")
        for name, row in result["paired"].items():
            pt.add_row(name, fmt_interval(row["exposed_fetch_s"], "+.2f", 1e3), fmt_interval(row["tokens_per_second"], "+.2f"),
                       fmt_interval(row["on_demand_stall_per_fetch_s"], "+.1f", 1e6), fmt_interval(row["hit_rate"], "+.3f"))
        console.print(pt)

    peers = result.get("peers")
    if peers and "error" in peers:
        console.print(f"[bold yellow]peers not measured:[/] {peers['error']}")
    elif peers:
        pt = Table(title="Peers on the same prompts (ratio = pdflash arm tokens/s / peer tokens/s)", title_justify="left")
        pt.add_column("peer")
        pt.add_column("tokens/s", justify="right")
        pt.add_column("decode tokens", justify="right")
        for arm in cfg["arms"]:
            pt.add_column(f"ratio {arm}", justify="right")
        for r in peers["arms"]:
            err = r["notes"].get("error")
            ratios = [fmt(peers["ratios"][a].get(r["arm"], {}).get("ratio")) for a in cfg["arms"]]
            pt.add_row(r["arm"], fmt(r["tokens_per_second"]) + (f" ({err})" if err else ""), str(r["decode_tokens"]), *ratios)
        for arm, why in peers.get("skipped", {}).items():
            pt.add_row(arm, f"not run: {why}", "-", *["n/a"] * len(cfg["arms"]))
        console.print(pt)
        console.print(peers["note"])

    failed = [f"{k}: {v}" for k, v in result["checks"].items() if not v.get("ok")]
    if failed:
        console.print("[bold yellow]checks that did not hold:[/] " + "; ".join(failed))
    dec = result["decision"]
    body = "\n".join(dec["reasons"]) or "(no reasons recorded)"
    partial = result.get("partial")
    if partial:  # interrupted: the figures cover the finished repetitions only
        console.print(Panel(body, title=f"PARTIAL ({partial['repetitions_finished']} of {partial['repetitions_asked']} "
                                        f"repetitions, interrupted): no verdict; the evidence so far points to "
                                        f"{dec['verdict'].upper()}", title_align="left", border_style="bold yellow"))
        return
    console.print(Panel(body, title=f"verdict: {dec['verdict'].upper()}", title_align="left",
                        border_style=VERDICT_STYLE.get(dec["verdict"], "bold")))


# -- figure -------------------------------------------------------------------------------------
def write_figure(result: dict, path: Path) -> str | None:
    """Draw the PNG; returns None when written, else one line saying why not (the JSON stands)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no figure was written (pip install matplotlib); the JSON holds every number"

    arms = result["config"]["arms"]
    summary = result["summary"]
    tl = result.get("timeline") or {"available": False, "reason": "not recorded"}
    traced = list(tl.get("arms", {}).items()) if tl.get("available") else []
    n_tl = max(1, len(traced))
    fig = plt.figure(figsize=(12, 4.2 + 2.2 * n_tl), constrained_layout=True)
    gs = fig.add_gridspec(1 + n_tl, 2, height_ratios=[2.0] + [1.1] * n_tl)
    _interval_bars(fig.add_subplot(gs[0, 0]), arms, [summary[a]["exposed_fetch_s"] for a in arms], 1e3,
                   "exposed fetch per run, decode window (ms)")
    _interval_bars(fig.add_subplot(gs[0, 1]), arms, [summary[a]["tokens_per_second"] for a in arms], 1.0,
                   "decode tokens/s")
    if traced:
        for i, (arm, t) in enumerate(traced):
            _timeline(fig.add_subplot(gs[1 + i, :]), arm, t)
    else:
        ax = fig.add_subplot(gs[1, :])
        ax.axis("off")
        ax.text(0.5, 0.5, f"link timeline not available: {tl.get('reason', 'not recorded')}", ha="center", va="center")
    dec = result["decision"]
    fig.suptitle(f"pdflash bench-priority: verdict {dec['verdict']}  (means with 95 % bootstrap intervals)")
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        plt.close(fig)
        raise PdflashError(f"could not write {path}: {exc.strerror or exc}") from None
    plt.close(fig)
    return None


def _interval_bars(ax, arms: list[str], ivs: list[dict], scale: float, title: str) -> None:
    xs = range(len(arms))
    for x, arm, iv in zip(xs, arms, ivs):
        if iv["mean"] is None:
            ax.text(x, 0, "n/a", ha="center", va="bottom")
            continue
        m, lo, hi = iv["mean"] * scale, iv["lo"] * scale, iv["hi"] * scale
        ax.bar(x, m, color=ARM_COLORS.get(arm, "#333333"), alpha=0.85)
        ax.errorbar(x, m, yerr=[[m - lo], [hi - m]], color="black", capsize=5, lw=1.2)
        ax.annotate(f"{m:.3g}", (x, hi), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), arms)
    ax.margins(y=0.12)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def _timeline(ax, arm: str, t: dict) -> None:
    rows = t["transfers"]
    for r in rows:
        b = r["band"]
        y = b if b <= 2 else 3
        if r.get("submit_s") is not None and r["submit_s"] < r["start_s"]:  # queued: thin line from submit to start
            ax.hlines(y, 1e3 * r["submit_s"], 1e3 * r["start_s"], colors=BAND_COLORS.get(b, "#bcbd22"), lw=0.8, alpha=0.5)
        ax.broken_barh([(1e3 * r["start_s"], max(1e3 * (r["end_s"] - r["start_s"]), 1e-3))], (y - 0.35, 0.7),
                       facecolors=BAND_COLORS.get(b, "#bcbd22"), edgecolors="black", linewidth=0.3, alpha=0.75)
    ax.axvline(0, color="black", lw=0.8, ls=":")
    ax.axvline(1e3 * t["step_s"], color="black", lw=0.8, ls=":")
    ax.set_yticks([0, 1, 2], [BAND_LABELS[0], BAND_LABELS[1], BAND_LABELS[2]])
    ax.set_ylim(-0.6, 2.6)
    ax.invert_yaxis()
    lo = min([0.0] + [1e3 * r["submit_s"] for r in rows if r.get("submit_s") is not None])
    ax.set_xlim(lo - 0.02 * (1e3 * t["step_s"] - lo), 1e3 * t["step_s"] * 1.02)
    ax.set_xlabel("ms from the start of the step (dotted: step start and end; bar: transfer, thin line: queued since submit)")
    ax.set_title(f"{arm}: link transfers of verify step {t['step']} of {t['steps']}, by band at completion "
                 f"(promoted prefetches end in band 0; {len(rows)} transfers)", loc="left")
    ax.grid(axis="x", alpha=0.3)
