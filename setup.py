"""Thin shim for tools that still call setup.py; metadata is in pyproject.toml."""

from setuptools import setup

setup()
