"""Peak resident memory of `pdflash generate` on long prompts: chunked prefill against one forward.

    python benchmarks/prefill_memory.py                      # embedded pair at its full context
    python benchmarks/prefill_memory.py --tiny-tokens 8192 12000

Each run is a fresh `pdflash generate - --max-new-tokens 8 --json` process reading a prompt of
exactly N tokens (Python standard library source, cut to N tokens of the model's tokenizer) on
stdin; its peak RSS is ru_maxrss of that process, read by a parent shell made for the one run. "one forward" runs the same command with
offload/prompt.py's PREFILL_CHUNK raised above N, i.e. the whole prompt in one forward as before
chunked prefill. ``--tiny-tokens`` adds runs on a tiny synthetic checkpoint whose context is
raised to 32768 positions, where the attention of one forward grows with N squared.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ONE_FORWARD = (
    "import importlib, sys\n"
    "importlib.import_module('pdflash.offload.prompt').PREFILL_CHUNK = 10**9\n"
    "from pdflash.cli.main import main\n"
    "main()\n"
)


def prompt_of(model: Path, n: int) -> str:
    """Standard-library source text that encodes to exactly ``n`` tokens (or fewer, never more)."""
    import argparse as a1
    import collections
    import dataclasses
    import email.message
    import typing

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    src = "".join(inspect.getsource(m) for m in (a1, collections, email.message, typing, dataclasses))
    text = tok.decode(tok(src, verbose=False).input_ids[:n])
    while len(tok(text, verbose=False).input_ids) > n:
        text = text[:-16]
    return text


def run(label: str, model: Path | None, n: int, extra: list[str]) -> dict:
    from pdflash.offload.embedded import embedded_target

    prompt = prompt_of(model or embedded_target(), n)
    base = ["generate", "-", "--max-new-tokens", "8", "--json", *(["--model", str(model)] if model else []), *extra]
    rows = {}
    # ru_maxrss of children is the largest child so far: each measurement gets its own parent process
    for name, head in (("chunked", [sys.executable, "-m", "pdflash.cli.main"]),
                       ("one forward", [sys.executable, "-c", ONE_FORWARD])):
        code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(p.returncode)")
        proc = subprocess.run([sys.executable, "-c", code, *head, *base], input=prompt, capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"{label} {name} failed: {proc.stderr.strip()[-500:]}")
        report = json.loads(proc.stdout)
        rows[name] = {"peak_rss_mib": int(proc.stderr.strip().splitlines()[-1]) / 1024,
                      "prompt_tokens": report["prompt_tokens"], "token_ids": report["token_ids"]}
    same = rows["chunked"]["token_ids"] == rows["one forward"]["token_ids"]
    print(f"{label}: {rows['chunked']['prompt_tokens']} prompt tokens + 8: chunked {rows['chunked']['peak_rss_mib']:.0f} MiB, "
          f"one forward {rows['one forward']['peak_rss_mib']:.0f} MiB, same tokens: {same}", flush=True)
    return {"label": label, **rows, "same_tokens": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny-tokens", type=int, nargs="*", default=[], help="prompt lengths for the tiny 32k checkpoint")
    ap.add_argument("--no-embedded", action="store_true", help="skip the embedded pair")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    results = []
    if not args.no_embedded:
        results.append(run("embedded pair (speculative)", None, 4088, []))
        results.append(run("embedded target (--no-draft)", None, 4088, ["--no-draft"]))
    if args.tiny_tokens:
        from pdflash.offload.config import ModelPreset
        from pdflash.offload.synthetic import write_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            ck = write_checkpoint(Path(tmp) / "tiny32k", ModelPreset.from_name("tiny"), seed=0)
            cfg = json.loads((ck / "config.json").read_text())
            cfg["max_position_embeddings"] = 32768
            (ck / "config.json").write_text(json.dumps(cfg))
            for n in args.tiny_tokens:
                results.append(run(f"tiny, context 32768, {n} tokens", ck, n, []))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
