"""Strata: a Mixture-of-Experts model server that shares the desktop GPU."""

__version__ = "0.1.0"
