"""Inter-process edges: the D-Bus service, strata-ctl, the GameMode watcher."""
