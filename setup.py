# The build is described in pyproject.toml; this file only hooks the native
# scheduler's cffi build script into setuptools (cffi_modules has no
# pyproject.toml spelling).
from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
