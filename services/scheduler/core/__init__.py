"""Pure scheduling core: no gRPC, no protobuf; clock and ids are injected.

Each name has one address: import it from the module that defines it (the core's
SchedulerCore from core/scheduler.py, its values from core/types.py, the step contract from
common/step.py)."""
