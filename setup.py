"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron-core.

A shim: the package's metadata, dependencies, extras, console script and package data are in
pyproject.toml (PEP 621). Kept for tools that still call `python setup.py ...`."""

from setuptools import setup

setup()
