"""Fault and bad-input sweeps (a package, so its conftest does not shadow tests/conftest.py)."""
