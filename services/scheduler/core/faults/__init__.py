"""Requests whose worker failed or drained, and waiting for a worker when none is left: failover, recovery and drain, as pure decisions."""
