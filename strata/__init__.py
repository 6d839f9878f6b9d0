"""Strata: a Mixture-of-Experts model server that shares the desktop GPU."""

from __future__ import annotations

import os

__version__ = "0.1.0"

# From a checkout on PYTHONPATH (no install): the code folders sit beside this one, where an
# install maps them (pyproject.toml's package-dir) into strata.vmm, strata.engine, ...
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "daemon")) and os.path.isfile(
    os.path.join(_root, "daemon", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]
del _root
