"""Settings: the run config, a silo's node config, their validation, the registry."""
