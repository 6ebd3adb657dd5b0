"""``pdflash build-native``: rebuild the native scheduler in place."""

from __future__ import annotations

import shutil
import sysconfig
from typing import Annotated, Optional

import typer

from pdflash import PdflashError

SANITIZERS = ("address", "undefined", "thread")


def build_native(
    debug: Annotated[bool, typer.Option("--debug", help="Build with -O1 -g and frame pointers.")] = False,
    sanitize: Annotated[
        Optional[str],
        typer.Option(help="Instrument with a sanitizer: address, undefined or thread."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the compiler commands.")] = False,
) -> None:
    """Rebuild the native scheduler library in place and print where it is.

    Examples:
      pdflash build-native
      pdflash build-native --sanitize address
    """
    if sanitize is not None and sanitize not in SANITIZERS:
        raise PdflashError(f"unknown sanitizer {sanitize!r}: use one of {', '.join(SANITIZERS)}", exit_code=2)
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("cc") is None:
        raise PdflashError(
            f"no C compiler found ({cc!r} is not on PATH); install gcc or clang (e.g. 'apt-get install gcc') and retry"
        )
    from pdflash.native import build_ffi

    try:
        path = build_ffi.build_in_place(debug=debug, sanitize=sanitize, verbose=verbose)
    except Exception as exc:  # distutils CompileError / LinkError carry the compiler's message
        raise PdflashError(f"building the native scheduler failed: {exc}") from None
    typer.echo(path)
    if sanitize:
        lib = {"address": "libasan.so", "thread": "libtsan.so", "undefined": "libubsan.so"}[sanitize]
        typer.echo(
            f"note: load it with the sanitizer runtime preloaded, e.g. LD_PRELOAD=$(cc -print-file-name={lib}) python3 ...;"
            " run 'pdflash build-native' again for a normal build",
            err=True,
        )
