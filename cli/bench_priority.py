"""`pdflash bench-priority`: the route-ahead band ablation with a ship / no-ship verdict."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def _split_arms(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _model_pair(model: Path | None, draft: Path | None) -> tuple[Path, Path]:
    """(target, draft) directories: both given, or neither (the embedded pair)."""
    from pdflash import PdflashError

    if model is None:
        if draft is not None:
            raise PdflashError("--draft needs --model: give the target the draft was fitted to", exit_code=2)
        from pdflash.offload.embedded import embedded_draft, embedded_target

        return embedded_target(), embedded_draft()
    if draft is None:
        raise PdflashError(f"give --draft DIR: the DFlash draft fitted to --model {model} (see pdflash make-synthetic --draft-preset)",
                           exit_code=2)
    return model, draft


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def bench_priority(
    model: Annotated[Path | None, typer.Option(help="Target checkpoint directory (config.json, safetensors, tokenizer); default: the embedded model pair.")] = None,
    draft: Annotated[Path | None, typer.Option(help="DFlash draft checkpoint directory fitted to the target (needed with --model).")] = None,
    arms: Annotated[str, typer.Option(help="Comma-separated arms: flat, banded, on-demand, resident, oracle.")] = "flat,banded,on-demand,resident,oracle",
    repetitions: Annotated[int, typer.Option(help="Measured repetitions; each runs every arm on every prompt in a shuffled arm order.")] = 5,
    prompts: Annotated[int, typer.Option("--prompts", help="How many of the built-in prompts to use (ignored when --prompt is given).")] = 3,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt text; repeat the option for several prompts.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per run (end-of-sequence tokens are ignored, so every run makes exactly this many).")] = 32,
    block_size: Annotated[str, typer.Option(help="Verify block size: auto (the block planner picks each step's length, up to the draft's trained block size) or a fixed N. The oracle arm always verifies full blocks.")] = "auto",
    draft_acceptance: Annotated[float | None, typer.Option(help="Oracle-acceptance mode: each drafted token is the target's own with probability P (for drafts with random weights).")] = None,
    expert_cache_fraction: Annotated[float, typer.Option(help="Expert cache of the budget arms as a fraction of all experts.")] = 0.25,
    expert_cache_mib: Annotated[float | None, typer.Option(help="Expert cache of the budget arms in MiB (overrides --expert-cache-fraction).")] = None,
    device: Annotated[str, typer.Option(help="Where to compute: cpu, cuda, cuda:N, or auto (cuda when available).")] = "auto",
    dtype: Annotated[str | None, typer.Option(help="Compute dtype: bfloat16, float16 or float32 (default: the checkpoint's).")] = None,
    link_gbps: Annotated[float | None, typer.Option(help="CPU only: simulate a host-to-device link of this many GB/s.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the arm orders, the oracle proposals and the bootstrap.")] = 0,
    warmup: Annotated[int, typer.Option(help="Discarded rounds of every arm before the measured repetitions.")] = 1,
    history_depth: Annotated[int, typer.Option(help="Depth of the history prefetch (background band) in the flat, banded and oracle arms.")] = 2,
    predictor: Annotated[str, typer.Option(help="Route-ahead predictor of the flat and banded arms: draft-router, previous, lookahead, or a '+'-joined union.")] = "draft-router",
    workers: Annotated[int, typer.Option(help="Copy threads of the fetch scheduler.")] = 2,
    timeline: Annotated[bool, typer.Option("--timeline/--no-timeline", help="Trace one step of the flat and banded arms for the link timeline in the figure.")] = True,
    output: Annotated[Path, typer.Option(help="Where to write the JSON result; the PNG figure goes next to it with the suffix .png.")] = Path("bm3.json"),
    peers: Annotated[bool, typer.Option("--peers", help="Also run transformers (resident, and accelerate offload on CUDA) on the same prompts and report tokens/s ratios.")] = False,
    peer_time_limit: Annotated[float, typer.Option(help="With --peers: decode time limit of each peer arm in seconds.")] = 120.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the JSON result on stdout instead of the tables.")] = False,
) -> None:
    """Measure whether the route-ahead priority band pays: flat vs banded prefetch, with on-demand,
    all-resident and oracle arms as bounds, on one loaded model; writes JSON + PNG and a verdict.

    Examples:
      pdflash bench-priority --device cpu --link-gbps 0.2
      pdflash bench-priority --model /tmp/tiny --draft /tmp/tiny/draft --device cpu --link-gbps 0.05 --draft-acceptance 0.7
      pdflash bench-priority --model /data/oss20b --draft /data/oss20b/draft --device cuda --draft-acceptance 0.7 --peers --output out/bm3.json
    """
    from rich.console import Console

    from pdflash.bench.config import PriorityConfig
    from pdflash.bench.priority import run_priority_bench
    from pdflash.bench.report import print_report, write_figure, write_json

    model, draft = _model_pair(model, draft)
    cfg = PriorityConfig(
        model_dir=str(model), draft_dir=str(draft), arms=_split_arms(arms), repetitions=repetitions,
        prompts=tuple(prompt) if prompt else None, n_prompts=prompts, max_new_tokens=max_new_tokens,
        block_size=block_size, draft_acceptance=draft_acceptance, expert_cache_fraction=expert_cache_fraction,
        expert_cache_mib=expert_cache_mib, device=_resolve_device(device), dtype=dtype, link_gbps=link_gbps, seed=seed,
        warmup=warmup, history_depth=history_depth, predictor=predictor, workers=workers, timeline=timeline,
        peers=peers, peer_time_limit_s=peer_time_limit, output=str(output),
    )
    err = Console(stderr=True, highlight=False)
    result = run_priority_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))

    write_json(result, output)
    png = output.with_suffix(".png")
    why = write_figure(result, png)
    if why:
        err.print(f"Warning: {why}", markup=False)
    if json_out:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_report(result, Console(width=None if sys.stdout.isatty() else 180))
    err.print(f"wrote {output}" + ("" if why else f" and {png}"), markup=False)
    partial = result.get("partial")
    if partial:
        from pdflash import Interrupted

        raise Interrupted(f"stopped by Ctrl-C after {partial['repetitions_finished']} of {partial['repetitions_asked']} "
                          f"repetitions; {output} holds the finished ones, marked partial (no verdict)")
    verdict = result["decision"]["verdict"]
    err.print(f"VERDICT: {verdict.upper()}", style="bold", markup=False)
