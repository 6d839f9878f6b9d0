"""The systemd user unit and the D-Bus activation file, shipped as package data.

These files are the one copy: ``strata service install`` reads them from this package
(``importlib.resources``) and fills in ``@STRATA@``; see docs/install.md.
"""
