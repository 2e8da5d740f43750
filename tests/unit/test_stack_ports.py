"""The launcher's free ports never repeat within one stack."""

from __future__ import annotations

from fairserve.launcher.stack import StackPorts, free_ports


def test_a_stacks_ports_are_distinct() -> None:
    for _ in range(20):
        ports = StackPorts.free(num_workers=3)
        every = [ports.gateway, ports.gateway_grpc, ports.scheduler, ports.scheduler_metrics,
                 ports.kvcache, ports.kvcache_metrics, *(p for pair in ports.workers for p in pair)]
        assert len(every) == len(set(every)) == 12
    assert len(set(free_ports(50))) == 50
