"""The model pair that ships with pdflash: a small gpt-oss-architecture MoE trained on the
Python standard library and its DFlash draft (see tools/train_embedded.py and
models/stdlib-moe/training.json for how it was made).

``pdflash generate`` uses it when no ``--model`` is given, so the tool works offline out of
the box and shows real routing, prefetch and speculation behaviour.
"""

from __future__ import annotations

from pathlib import Path

from pdflash import PdflashError

NAME = "stdlib-moe"
ROOT = Path(__file__).resolve().parent.parent / "models" / NAME


def embedded_target() -> Path:
    """Checkpoint directory of the embedded target (MXFP4 experts, like gpt-oss-20b)."""
    if not (ROOT / "config.json").is_file():
        raise PdflashError(
            f"the embedded model is missing from this installation ({ROOT}); reinstall pdflash or pass --model DIR"
        )
    return ROOT


def embedded_draft() -> Path:
    """Checkpoint directory of the embedded DFlash draft, trained for the embedded target."""
    path = ROOT / "draft"
    if not (path / "config.json").is_file():
        raise PdflashError(f"the embedded draft is missing from this installation ({path}); pass --draft DIR or --no-draft")
    return path
