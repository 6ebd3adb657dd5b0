"""Decoding arms compared in one process, round by round: a paired A/B with less noise than
separate runs minutes apart.

    python benchmarks/bench_paired.py --rounds 8                       # embedded pair, `make demo` setting
    python benchmarks/bench_paired.py --arms plain,auto,block4 --prompts 3 --out paired.json

The runtime is loaded once, as ``pdflash generate`` loads it (its option rules: on the CPU device
a cache size or ``--link-gbps`` makes an offload experiment). Then, for each prompt and round,
every arm runs once on an emptied expert cache, the order reversed every other round. The arms:

  plain     plain decoding (``--no-draft``)
  auto      speculative decoding with the block planner (the default of ``generate``)
  blockN    speculative decoding with a fixed block of N (``--block-size N``)
  NAME      with ``--variant NAME=JSON``: the block planner with those BlockPlanner keyword arguments

Route-ahead prefetch is off and prompt lookup on, as ``generate`` runs by default. Reports per
prompt each arm's median tokens per second and its ratio to ``plain``, and per arm the median,
geometric mean and lowest of those ratios over the prompts, and whether every arm produced
plain decoding's tokens. What it does not measure: a fresh process's first-call costs (model
load, warm-up), which ``bench_default_vs_plain.py`` includes as a new user meets them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

from bench_default_vs_plain import PROMPTS  # noqa: E402


def parse_arms(text: str, variants: dict | None = None) -> list[tuple[str, int | None]]:
    """'plain,auto,block4' -> [(name, fixed block or None)]; raises ValueError on a bad name.
    ``variants``: names of planner variants (--variant), arms like auto."""
    arms = []
    for name in text.split(","):
        if name in ("plain", "auto") or name in (variants or {}):
            arms.append((name, None))
        elif name.startswith("block") and name[5:].isdigit() and int(name[5:]) >= 1:
            arms.append((name, int(name[5:])))
        else:
            raise ValueError(f"unknown arm {name!r}: use plain, auto, blockN or a --variant name")
    if "plain" not in [a for a, _ in arms] or len(set(arms)) != len(arms):
        raise ValueError("the arms must include plain, each once")
    return arms


def run_arm(rt, draft_dir, ids: list[int], name: str, block: int | None, max_new_tokens: int,
            planner_options: dict | None = None):
    from pdflash.draft import generate_with_draft
    from pdflash.offload.generate import generate

    rt.reset_cache()
    if name == "plain":
        return generate(rt, ids, max_new_tokens=max_new_tokens)
    res, _ = generate_with_draft(rt, ids, draft_dir=draft_dir, max_new_tokens=max_new_tokens, auto=block is None,
                                 block_size=block, predictor=None, planner_options=planner_options)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint (default: the embedded model)")
    ap.add_argument("--draft", default=None, help="draft checkpoint (default: the embedded draft)")
    ap.add_argument("--arms", default="plain,auto")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--expert-cache-experts", type=int, default=64)
    ap.add_argument("--link-gbps", type=float, default=2.0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="a planner arm NAME (name it in --arms): BlockPlanner keyword arguments as a JSON object")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = {}
    from pdflash.draft.planner import parse_variant

    for spec in args.variant:
        try:
            name, kw = parse_variant(spec)
        except ValueError as exc:
            ap.error(f"--variant {exc}")
        if "," in name or name in ("plain", "auto") or name.startswith("block"):
            ap.error(f"--variant {name}: a new arm name (not plain, auto or blockN, no commas)")
        variants[name] = kw
    try:
        arms = parse_arms(args.arms, variants)
    except ValueError as exc:
        ap.error(f"--arms: {exc}")
    if args.rounds < 1 or not 1 <= args.prompts <= len(PROMPTS) or args.max_new_tokens < 1:
        ap.error(f"--rounds and --max-new-tokens at least 1, --prompts 1 .. {len(PROMPTS)}")

    from pdflash.cli.generate import _load_options
    from pdflash.draft import draft_block_size
    from pdflash.offload.cache import DEFAULT_EVICTION
    from pdflash.offload.embedded import embedded_draft, embedded_target
    from pdflash.offload.runtime import OffloadedModel

    model = args.model or embedded_target()
    draft = args.draft or embedded_draft()
    opts = _load_options(device=args.device, dtype="auto", expert_cache_mib=None,
                         expert_cache_experts=args.expert_cache_experts, link_gbps=args.link_gbps, eviction=DEFAULT_EVICTION,
                         lookahead_depth=0, history_depth=0, show_progress=False)
    opts["block_tokens"] = draft_block_size(draft, None)  # as generate loads it: the cache minimum covers a verify block
    per_prompt = {}
    with OffloadedModel.load(model, **opts) as rt:
        for prompt in PROMPTS[: args.prompts]:
            ids = rt.tokenizer(prompt).input_ids
            tps: dict[str, list[float]] = {name: [] for name, _ in arms}
            same = True
            for r in range(args.rounds):
                tokens = {}
                for name, block in (arms if r % 2 == 0 else arms[::-1]):
                    res = run_arm(rt, draft, ids, name, block, args.max_new_tokens, variants.get(name))
                    tps[name].append(res.tokens_per_second)
                    tokens[name] = res.token_ids
                same = same and all(t == tokens["plain"] for t in tokens.values())
            med = {name: statistics.median(v) for name, v in tps.items()}
            per_prompt[prompt] = {"tokens_per_second": tps, "median_tps": med, "same_tokens": same,
                                  "ratio": {n: med[n] / med["plain"] for n in med if n != "plain"}}
            print(f"{prompt[:26]!r:30} plain {med['plain']:6.1f} tok/s  " + "  ".join(
                f"{n} {r:.2f}x" for n, r in per_prompt[prompt]["ratio"].items()), flush=True)
    summary = {}
    for name, _ in arms:
        if name == "plain":
            continue
        ratios = [p["ratio"][name] for p in per_prompt.values()]
        summary[name] = {"median_ratio": statistics.median(ratios), "geomean_ratio": statistics.geometric_mean(ratios),
                         "lowest_ratio": min(ratios)}
        print(f"{name}: median {summary[name]['median_ratio']:.3f}x, geometric mean "
              f"{summary[name]['geomean_ratio']:.3f}x, lowest {summary[name]['lowest_ratio']:.3f}x")
    out = {"model": str(model), "draft": str(draft), "device": args.device, "expert_cache_experts": args.expert_cache_experts,
           "link_gbps": args.link_gbps, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
           "arms": [n for n, _ in arms], "variants": variants, "per_prompt": per_prompt, "summary": summary,
           "all_same_tokens": all(p["same_tokens"] for p in per_prompt.values())}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
