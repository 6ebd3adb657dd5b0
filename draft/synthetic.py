"""Synthetic DFlash draft checkpoints: real names, shapes and dtypes, seeded random values.

``tiny`` is fitted to a target checkpoint (its hidden size, heads, vocabulary, layer count and
rope); ``gpt-oss-20b-DFlash`` has the published drafter's shape (about 0.8B parameters, 1.6 GB in
bf16) and, when a target directory is given, is checked against it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from pdflash import PdflashError
from pdflash.draft.config import DFlashConfig, TargetShape
from pdflash.draft.model import draft_tensor_shapes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synthetic_draft_tensors(config: DFlashConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Norm weights 1, every other tensor N(0, 0.02^2), drawn in name order from one seeded stream."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(draft_tensor_shapes(config).items()):
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(dtype).contiguous()
    return out


def shaped_draft_config(preset: str, target: TargetShape | None = None, *, block_size: int | None = None,
                        layers: int | None = None, intermediate_size: int | None = None) -> DFlashConfig:
    """The preset's draft config with its trained block length, depth or MLP width replaced (a
    cheaper or dearer draft of the same attention and vocabulary, e.g. to study what a draft pass
    costs against a target step)."""
    config = DFlashConfig.from_preset(preset, target)
    for what, value, least in (("block size", block_size, 2), ("layer count", layers, 1),
                               ("intermediate size", intermediate_size, 1)):
        if value is not None and value < least:
            raise PdflashError(f"a draft's {what} must be at least {least}, got {value}")
    if block_size is not None:
        config.block_size = int(block_size)
    if intermediate_size is not None:
        config.intermediate_size = int(intermediate_size)
    if layers is not None:
        kinds = config.layer_types
        config = replace(config, num_hidden_layers=int(layers),
                         layer_types=[kinds[i] if i < len(kinds) else "full_attention" for i in range(int(layers))])
    return config


def write_synthetic_draft(
    out_dir: str | Path,
    preset: str,
    target_dir: str | Path | None = None,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    block_size: int | None = None,
    layers: int | None = None,
    intermediate_size: int | None = None,
) -> DFlashConfig:
    """Write ``config.json`` + ``model.safetensors`` of a synthetic draft to ``out_dir``.

    ``block_size`` overrides the preset's trained block length (the weights do not depend on it);
    ``layers`` / ``intermediate_size`` its depth and MLP width (:func:`shaped_draft_config`).

    dtype defaults to the preset's (float32 for tiny, bfloat16 for gpt-oss-20b-DFlash).
    Returns the config written.
    """
    from safetensors.torch import save_file

    target = TargetShape.from_dir(target_dir) if target_dir is not None else None
    config = shaped_draft_config(preset, target, block_size=block_size, layers=layers, intermediate_size=intermediate_size)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise PdflashError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    dtype = dtype or _DTYPES[config.dtype]
    config.dtype = next(k for k, v in _DTYPES.items() if v == dtype)
    from safetensors import SafetensorError

    out = Path(out_dir)
    weights = out / "model.safetensors"
    partial = out / "model.safetensors.partial"
    try:
        out.mkdir(parents=True, exist_ok=True)
        tensors = synthetic_draft_tensors(config, seed, dtype)
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.chmod(partial, 0o666 & ~_umask())  # the writer's own mode may be 0600
        os.replace(partial, weights)
        (out / "config.json").write_text(config.to_json())
    except (OSError, SafetensorError) as exc:
        raise PdflashError(f"cannot write the draft checkpoint to {str(out)!r} ({_first_line(exc)}): free some space "
                           "or choose a writable directory") from None
    finally:
        partial.unlink(missing_ok=True)
    return config


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
