"""Settings: the schema every service declares its settings in, the fields several share, and the typed environment reading the shared token helpers use."""
