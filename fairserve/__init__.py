"""fairserve: fair, observable, cache-aware LLM serving as gRPC microservices.

This package holds the `fairserve` command (cli/), the launcher that runs the whole stack
(launcher/), and the generated gRPC stubs (v1/, built from proto/ by setup.py or `make proto`).
The services themselves live in the `services` and `common` packages."""
