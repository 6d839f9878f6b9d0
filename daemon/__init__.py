"""The daemon: configuration, policy, lease book, service, HTTP."""
