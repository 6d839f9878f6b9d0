"""The ``strata`` subcommands other than ``serve``: ``generate``, ``bench``, ``models``, ``pull``
and ``service install``. ``strata.cli`` dispatches to them; nothing in the daemon imports them."""
