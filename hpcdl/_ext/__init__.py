"""Compiled kernels, built from the Cython sources in ``ext/`` by ``pip install``."""
