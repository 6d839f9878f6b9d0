"""The daemon: its core here (the service, the worker and its engine port, the status, the
configuration, the model library), the VRAM control plane (``control/``), the HTTP edge
(``api/``) and the ``strata`` subcommands (``commands/``)."""
