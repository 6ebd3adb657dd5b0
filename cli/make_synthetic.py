"""`pdflash make-synthetic`: write a gpt-oss or Qwen3-MoE checkpoint with seeded random weights."""

from __future__ import annotations

import errno
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from pdflash import PdflashError


def make_synthetic(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into (created if missing).")],
    preset: Annotated[str, typer.Option(help="Model shape: tiny or gpt-oss-20b (gpt-oss); qwen3-tiny, qwen3-30b-a3b or qwen3-coder-30b-a3b (Qwen3-MoE).")] = "tiny",
    mxfp4: Annotated[bool, typer.Option("--mxfp4", help="gpt-oss presets: store the experts in MXFP4 blocks and scales like openai/gpt-oss-20b.")] = False,
    fp8: Annotated[bool, typer.Option("--fp8", help="Qwen3-MoE presets: store experts and attention in 128x128-block FP8 like Qwen/Qwen3-30B-A3B-FP8.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random weights; the same seed writes the same bytes.")] = 0,
    dtype: Annotated[str, typer.Option(help="dtype of the non-quantized tensors: bfloat16, float32 or float16.")] = "bfloat16",
    shard_mib: Annotated[int, typer.Option(help="Largest safetensors shard in MiB; more data is split over shards with an index.")] = 4096,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object describing what was written.")] = False,
    draft_preset: Annotated[str | None, typer.Option(help="Also write a synthetic DFlash draft fitted to this target: tiny, gpt-oss-20b-DFlash or Qwen3-Coder-30B-A3B-DFlash.")] = None,
    draft_dir: Annotated[Path | None, typer.Option(help="Directory of the draft checkpoint; the default is OUT_DIR/draft.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a non-empty directory, replacing the checkpoint files there (by default such a directory is refused).")] = False,
    draft_block_size: Annotated[int | None, typer.Option(help="With --draft-preset: the draft's trained block length instead of the preset's (e.g. 8 for a tiny draft shaped like gpt-oss-20b-DFlash's blocks).")] = None,
    draft_layers: Annotated[int | None, typer.Option(help="With --draft-preset: the draft's number of layers instead of the preset's.")] = None,
    draft_intermediate: Annotated[int | None, typer.Option(help="With --draft-preset: the draft's MLP width instead of the preset's (with --draft-layers: a cheaper or dearer draft pass).")] = None,
    layers: Annotated[int | None, typer.Option(help="Override the preset's number of decoder layers (a short model with real layer shapes).")] = None,
    experts: Annotated[int | None, typer.Option(help="Override the preset's experts per layer (at least its top-k).")] = None,
    vocab: Annotated[int | None, typer.Option(help="Override the preset's vocabulary (embedding and lm_head rows; the tokenizer uses at most this many).")] = None,
) -> None:
    """Write a complete synthetic checkpoint (config, safetensors, tokenizer) that pdflash and transformers load.

    OUT_DIR must be new or empty unless --force is given. Free space is checked before anything
    is written; files are staged in a hidden folder inside OUT_DIR and renamed into place at the
    end, so an error, a full disk or Ctrl-C leaves OUT_DIR as it was.

    Examples:
      pdflash make-synthetic /tmp/tiny --preset tiny
      pdflash make-synthetic /data/oss20b --preset gpt-oss-20b --mxfp4
      pdflash make-synthetic /data/oss20b --preset gpt-oss-20b --mxfp4 --draft-preset gpt-oss-20b-DFlash
      pdflash make-synthetic /tmp/oss2 --preset gpt-oss-20b --mxfp4 --layers 2 --experts 8 --vocab 8192 --draft-preset tiny
      pdflash make-synthetic /tmp/q3 --preset qwen3-tiny --fp8 --draft-preset tiny
      pdflash make-synthetic /data/q3coder --preset qwen3-coder-30b-a3b --fp8 --draft-preset Qwen3-Coder-30B-A3B-DFlash
    """
    from pdflash.cli import checks
    from pdflash.cli.staging import Staged, check_destination, check_space, human_bytes
    from pdflash.draft import TargetShape, draft_tensor_shapes, shaped_draft_config, write_synthetic_draft
    from pdflash.offload.config import SPECIAL_TOKENS, ModelPreset
    from pdflash.offload.synthetic import checkpoint_bytes, write_checkpoint

    checks.at_least("--shard-mib", shard_mib, 1)
    checks.choice("--dtype", dtype, ("bfloat16", "float32", "float16"))
    checks.seed(seed)
    if mxfp4 and fp8:
        raise checks.usage("choose one of --mxfp4 (gpt-oss) and --fp8 (Qwen3-MoE)")
    quant = "mxfp4" if mxfp4 else "fp8" if fp8 else None
    p = _shaped(ModelPreset.from_name(preset), layers, experts, vocab)
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    p.hf_config(ids, quant=quant)  # a format the preset's family has no: fail before writing
    need = checkpoint_bytes(p, quant=quant, dtype=dtype) + (256 << 10)  # + tokenizer and config files
    for flag, value, least in (("--draft-block-size", draft_block_size, 2), ("--draft-layers", draft_layers, 1),
                               ("--draft-intermediate", draft_intermediate, 1)):
        if value is not None:
            if draft_preset is None:
                raise checks.usage(f"{flag} applies to the draft: add --draft-preset")
            checks.at_least(flag, value, least)
    shape = {"block_size": draft_block_size, "layers": draft_layers, "intermediate_size": draft_intermediate}
    if draft_preset is not None:  # fail before writing the target when the draft cannot fit it
        dcfg = shaped_draft_config(draft_preset, TargetShape.from_config(p.hf_config(ids)), **shape)
        need += sum(math.prod(s) for s in draft_tensor_shapes(dcfg).values()) * _ITEMSIZE[dtype]
    separate_draft = draft_preset is not None and draft_dir is not None
    check_destination(out_dir, force)
    if separate_draft:
        check_destination(draft_dir, force, "--draft-dir")
    check_space(out_dir, need)  # before anything is created
    t0 = time.perf_counter()
    try:
        with Staged(out_dir, force) as stage, (Staged(draft_dir, force) if separate_draft else nullcontext()) as dstage:
            write_checkpoint(stage.path, p, quant=quant, seed=seed, dtype=dtype, max_shard_bytes=shard_mib << 20,
                             progress=sys.stderr.isatty() and not json_out)
            if draft_preset is not None:
                dcfg = write_synthetic_draft(dstage.path if separate_draft else stage.path / "draft", draft_preset,
                                             target_dir=stage.path, seed=seed, dtype=dtype, **shape)
    except OSError as exc:
        why = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise PdflashError(f"cannot write the checkpoint to {out_dir} ({why}); nothing was kept: free some space "
                           "or choose a writable directory") from None
    out = out_dir
    files = sorted(f.name for f in out.iterdir() if f.is_file())
    size = sum((out / f).stat().st_size for f in files)
    info = {
        "path": str(out),
        "preset": p.name,
        "layers": p.num_hidden_layers,
        "experts_per_layer": p.num_local_experts,
        "vocab": p.vocab_size,
        "family": p.family,
        "experts": quant or dtype,
        "seed": seed,
        "bytes": size,
        "files": files,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if draft_preset is not None:
        ddir = draft_dir if draft_dir is not None else out / "draft"
        info["draft"] = {"path": str(ddir), "preset": draft_preset, "block_size": dcfg.block_size,
                         "layers": dcfg.num_hidden_layers, "intermediate_size": dcfg.intermediate_size,
                         "bytes": sum(f.stat().st_size for f in ddir.iterdir() if f.is_file())}
    if json_out:
        print(json.dumps(info))
        return
    print(f"wrote {out}: preset {p.name} ({p.num_hidden_layers} layers x {p.num_local_experts} experts), experts {info['experts']}, {human_bytes(size)} in {len(files)} files ({info['seconds']} s)")
    if draft_preset is not None:
        print(f"wrote draft {info['draft']['path']}: preset {draft_preset}, {human_bytes(info['draft']['bytes'])}")
        print(f"use it with: pdflash generate \"Hello\" --model {out} --draft {info['draft']['path']}")
    else:
        print(f"use it with: pdflash generate \"Hello\" --model {out}")


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _shaped(p, layers: int | None, experts: int | None, vocab: int | None):
    """The preset with --layers / --experts / --vocab applied (checked)."""
    from dataclasses import replace

    from pdflash.cli import checks
    from pdflash.offload.config import SPECIAL_TOKENS

    checks.at_least("--layers", layers, 1)
    checks.at_least("--experts", experts, p.num_experts_per_tok)
    checks.at_least("--vocab", vocab, len(SPECIAL_TOKENS) + 256)  # the byte-level tokenizer's floor
    if layers is None and experts is None and vocab is None:
        return p
    kw = {}
    if layers is not None:
        kw.update(num_hidden_layers=layers, layer_types=())  # () -> derived for the new depth
    if experts is not None:
        kw["num_local_experts"] = experts
    if vocab is not None:
        kw.update(vocab_size=vocab, tokenizer_vocab=min(vocab, p.tokenizer_vocab))
    return replace(p, **kw)
