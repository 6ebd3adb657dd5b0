"""``pdflash smoke``: prove the native scheduler works on this machine."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pdflash.native import NativeLibraryMissing


def smoke(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    cuda: Annotated[
        str, typer.Option(help="Also check the cuda backend: auto (when a GPU is visible), yes, or no.")
    ] = "auto",
    device: Annotated[str, typer.Option(help="Where to check, as for generate: auto (the memcpy backend, and cuda "
                                        "as --cuda says), cpu (the memcpy backend only), cuda or cuda:N (the cuda "
                                        "backend too, on that GPU; a bare N means cuda:N).")] = "auto",
) -> None:
    """Load the native scheduler and exercise all three bands: byte-exact data, on-demand
    overtaking queued background work, dedup, cancel, reset, close with waiters.

    Exit code 0 only if every check held (3 if one failed).

    Examples:
      pdflash smoke
      pdflash smoke --json
      pdflash smoke --device cuda:1
    """
    from pdflash import PdflashError
    from pdflash.native.smoke import run_smoke

    if cuda not in ("auto", "yes", "no"):
        raise PdflashError(f"--cuda must be auto, yes or no, got {cuda!r}", exit_code=2)
    cuda, index = _cuda_of_device(device, cuda)
    backends = ["memcpy"]
    import torch

    has_gpu = torch.cuda.is_available()
    if cuda == "yes" and not has_gpu:
        raise PdflashError(f"{'--cuda yes' if device == 'auto' else '--device ' + device} was given but no CUDA "
                           "device is visible to PyTorch; use --device cpu")
    if cuda == "yes" and index >= torch.cuda.device_count():
        raise PdflashError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if cuda == "yes" or (cuda == "auto" and has_gpu):
        backends.append("cuda")
    try:
        reports = [run_smoke(b, index) for b in backends]
    except NativeLibraryMissing:
        raise
    ok = all(r.ok for r in reports)
    if json_out:
        print(json.dumps({"ok": ok, "backends": [r.as_dict() for r in reports]}, indent=2))
    else:
        console = Console()
        for r in reports:
            checks = Table(title=f"pdflash smoke: {r.backend} backend", title_justify="left")
            checks.add_column("check")
            checks.add_column("result")
            checks.add_column("detail", overflow="fold")
            for c in r.checks:
                checks.add_row(c.name, "[green]ok[/]" if c.ok else "[red]FAILED[/]", c.detail)
            console.print(checks)
            bands = Table(title=f"bands ({r.backend}, mixed workload)", title_justify="left")
            for col in ("band", "submitted", "completed", "queue depth", "stall s", "queue wait s"):
                bands.add_column(col, justify="right" if col != "band" else "left")
            for b in r.bands:
                bands.add_row(
                    f"{b['band']} {b['name']}",
                    str(b["submitted"]),
                    str(b["completed"]),
                    str(b["queue_depth"]),
                    f"{b['stall_s']:.4f}",
                    f"{b['queue_wait_s']:.4f}",
                )
            console.print(bands)
        console.print("[green]all checks held[/]" if ok else "[red]some checks failed[/]")
    if not ok:
        sys.exit(3)


def _cuda_of_device(device: str, cuda: str) -> tuple[str, int]:
    """``--device`` read with ``--cuda``: (whether to check the cuda backend: auto, yes or no; the
    CUDA index). ``cpu`` means no, ``cuda[:N]`` (or a bare index N) means yes on that GPU; a
    ``--cuda`` that says otherwise is refused."""
    from pdflash import PdflashError
    from pdflash.cli import checks

    if device.isdigit():
        device = f"cuda:{device}"
    checks.device(device)
    if device == "auto":
        return cuda, 0
    want, index = ("no", 0) if device == "cpu" else ("yes", int(device.partition(":")[2] or 0))
    if cuda not in ("auto", want):
        raise PdflashError(f"--device {device} and --cuda {cuda} disagree: give one of them", exit_code=2)
    return want, index
