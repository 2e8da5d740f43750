"""gRPC plumbing shared by the services: server bootstrap and internal channels, the internal and worker tokens and TLS, peers and rate-limited refusal logs."""
