# The build is described in pyproject.toml; this file only hooks the native
# scheduler's cffi build script into setuptools (cffi_modules has no
# pyproject.toml spelling).
#
# setuptools silently ignores ``cffi_modules`` when cffi cannot be imported at
# build time (as with ``pip install --no-build-isolation`` in an environment
# without cffi), which would install pdflash without its C library. Fail loudly
# instead: the build must either compile the scheduler or stop.
import sys

from setuptools import setup

try:
    import cffi  # noqa: F401
except ImportError:
    sys.exit(
        "error: building pdflash needs cffi>=1.16 to compile its native scheduler, and cffi is not "
        "importable here. Run 'python -m pip install \"cffi>=1.16\" \"setuptools>=77\" wheel' first "
        "(or install without --no-build-isolation, which fetches them)."
    )

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
