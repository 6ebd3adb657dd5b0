"""`pdflash make-synthetic`: write a gpt-oss checkpoint with seeded random weights."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from pdflash import PdflashError


def make_synthetic(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into (created if missing).")],
    preset: Annotated[str, typer.Option(help="Model shape: tiny (CPU tests) or gpt-oss-20b (the full-size shape).")] = "tiny",
    mxfp4: Annotated[bool, typer.Option("--mxfp4", help="Store the experts in MXFP4 blocks and scales like openai/gpt-oss-20b.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random weights; the same seed writes the same bytes.")] = 0,
    dtype: Annotated[str, typer.Option(help="dtype of the non-quantized tensors: bfloat16, float32 or float16.")] = "bfloat16",
    shard_mib: Annotated[int, typer.Option(help="Largest safetensors shard in MiB; more data is split over shards with an index.")] = 4096,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object describing what was written.")] = False,
    draft_preset: Annotated[str | None, typer.Option(help="Also write a synthetic DFlash draft fitted to this target: tiny or gpt-oss-20b-DFlash.")] = None,
    draft_dir: Annotated[Path | None, typer.Option(help="Directory of the draft checkpoint; the default is OUT_DIR/draft.")] = None,
) -> None:
    """Write a complete synthetic checkpoint (config, safetensors, tokenizer) that pdflash and transformers load.

    Examples:
      pdflash make-synthetic /tmp/tiny --preset tiny
      pdflash make-synthetic /data/oss20b --preset gpt-oss-20b --mxfp4
      pdflash make-synthetic /data/oss20b --preset gpt-oss-20b --mxfp4 --draft-preset gpt-oss-20b-DFlash
    """
    from pdflash.draft import DFlashConfig, TargetShape, write_synthetic_draft
    from pdflash.offload.config import SPECIAL_TOKENS, ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    if shard_mib < 1:
        raise PdflashError(f"--shard-mib must be at least 1, got {shard_mib}")
    p = ModelPreset.from_name(preset)
    if draft_preset is not None:  # fail before writing the target when the draft cannot fit it
        shape = TargetShape.from_config(p.hf_config({tok: i for i, tok in enumerate(SPECIAL_TOKENS)}))
        DFlashConfig.from_preset(draft_preset, shape)
    t0 = time.perf_counter()
    out = write_checkpoint(
        out_dir, p, mxfp4=mxfp4, seed=seed, dtype=dtype, max_shard_bytes=shard_mib << 20,
        progress=sys.stderr.isatty() and not json_out,
    )
    files = sorted(f.name for f in out.iterdir() if f.is_file())
    size = sum((out / f).stat().st_size for f in files)
    info = {
        "path": str(out),
        "preset": p.name,
        "experts": "mxfp4" if mxfp4 else dtype,
        "seed": seed,
        "bytes": size,
        "files": files,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if draft_preset is not None:
        ddir = draft_dir if draft_dir is not None else out / "draft"
        dcfg = write_synthetic_draft(ddir, draft_preset, target_dir=out, seed=seed, dtype=dtype)
        info["draft"] = {"path": str(ddir), "preset": draft_preset, "block_size": dcfg.block_size,
                         "bytes": sum(f.stat().st_size for f in ddir.iterdir() if f.is_file())}
    if json_out:
        print(json.dumps(info))
        return
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    print(f"wrote {out}: preset {p.name}, experts {info['experts']}, {shown} in {len(files)} files ({info['seconds']} s)")
    if draft_preset is not None:
        print(f"wrote draft {info['draft']['path']}: preset {draft_preset}, {info['draft']['bytes'] / 1e6:.2f} MB")
        print(f"use it with: pdflash generate \"Hello\" --model {out} --draft {info['draft']['path']}")
    else:
        print(f"use it with: pdflash generate \"Hello\" --model {out}")
