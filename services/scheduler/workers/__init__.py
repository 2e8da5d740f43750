"""How workers join the scheduler and are stepped: registration and its checks, the
peer-address check, registration epochs, and the step link (a stream or a call per step)."""
