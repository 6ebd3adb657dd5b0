"""cffi API-mode build of the native library: the scheduler (pf_sched), the CPU expert kernel (pf_cpu),
a MoE layer's experts run from its routing (pf_layer), a graph's layers handed to the CPU through
flags (pf_relay) and the CPU draft pass (pf_draft).

Used by setuptools (``cffi_modules`` in setup.py) and by ``pdflash build-native``;
runnable alone: ``python native/build_ffi.py [--debug] [--sanitize KIND]``
builds ``_pf_sched*.so`` next to this file.

The cdef is read from the headers themselves (with the include
guards and preprocessor lines dropped), so the headers stay the single
description of the C API.
"""

from __future__ import annotations

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = [os.path.join(HERE, name) for name in ("pf_sched.h", "pf_cpu.h", "pf_layer.h", "pf_relay.h", "pf_draft.h")]
SOURCES = [os.path.join(HERE, name) for name in ("pf_sched.c", "pf_cpu.c", "pf_layer.c", "pf_relay.c", "pf_draft.c")]


def _cdef_from_header() -> str:
    text = "\n".join(open(h).read() for h in HEADERS)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        m = re.match(r"\s*#define\s+(PF_\w+)\s+(-?\d+)", line)
        if m:
            lines.append(f"#define {m.group(1)} {m.group(2)}")
        elif line.lstrip().startswith("#"):
            continue
        else:
            lines.append(line)
    return "\n".join(lines)


def make_builder(debug: bool = False, sanitize: str | None = None) -> FFI:
    cflags = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"]
    ldflags = ["-pthread"]
    if debug or sanitize:
        cflags += ["-O1", "-g", "-fno-omit-frame-pointer"]
    else:
        cflags += ["-O2"]
    if sanitize:
        cflags.append(f"-fsanitize={sanitize}")
        ldflags.append(f"-fsanitize={sanitize}")
    ffi = FFI()
    ffi.cdef(_cdef_from_header())
    ffi.set_source(
        "pdflash.native._pf_sched",
        '#include "pf_sched.h"\n#include "pf_cpu.h"\n#include "pf_layer.h"\n#include "pf_relay.h"\n#include "pf_draft.h"',
        sources=SOURCES,
        include_dirs=[HERE],
        libraries=["dl", "m"],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )
    return ffi


ffibuilder = make_builder(
    debug=os.environ.get("PDFLASH_NATIVE_DEBUG") == "1",
    sanitize=os.environ.get("PDFLASH_NATIVE_SANITIZE") or None,
)


def build_in_place(debug: bool = False, sanitize: str | None = None, verbose: bool = False) -> str:
    """Compile the extension into this folder; returns the path of the built library."""
    import tempfile

    ffi = make_builder(debug=debug, sanitize=sanitize)
    with tempfile.TemporaryDirectory() as tmp:
        built = ffi.compile(tmpdir=tmp, verbose=verbose)
        # compile() writes pdflash/native/_pf_sched*.so under tmp; move it here
        name = os.path.basename(built)
        target = os.path.join(HERE, name)
        # one library only: a stale build under another suffix (abi3 vs cpython-3xx) would shadow it
        for old in os.listdir(HERE):
            if old.startswith("_pf_sched.") and old.endswith(".so") and old != name:
                os.remove(os.path.join(HERE, old))
        os.replace(built, target)
    return target


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--sanitize", choices=["address", "undefined", "thread"])
    args = ap.parse_args()
    print(build_in_place(debug=args.debug, sanitize=args.sanitize, verbose=True))
