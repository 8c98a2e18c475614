# cffi's setuptools integration is driven from here; all metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["ckptfs/_native_build.py:ffibuilder", "ckptfs/_native_build.py:fuse_ffibuilder"])
