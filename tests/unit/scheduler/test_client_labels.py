"""Per-client metric labels stay bounded: the first clients seen keep their
own label, the rest count under "other", and every served-tokens series
only grows."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.core.types import ClientCounter, CoreStats, Policy
from services.scheduler.metrics import OTHER_CLIENTS, ClientLabels, SchedulerMetrics


def _clients(**served: int) -> list[ClientCounter]:
    return [ClientCounter(client_id=c, counter=float(n), served_tokens=n) for c, n in sorted(served.items())]


def _ids(clients: list[ClientCounter]) -> set[str]:
    return {c.client_id for c in clients}


def test_no_other_series_while_every_client_fits() -> None:
    labels = ClientLabels(limit=3)
    labelled, other = labels.split(_clients(a=5, b=1))
    assert _ids(labelled) == {"a", "b"} and other is None


def test_the_most_served_new_clients_take_the_free_labels_and_keep_them() -> None:
    labels = ClientLabels(limit=2)
    labelled, other = labels.split(_clients(a=1, b=50, c=30))
    assert _ids(labelled) == {"b", "c"} and other == 1
    # a grows past them: labels do not move.
    labelled, other = labels.split(_clients(a=500, b=60, c=40, d=7))
    assert _ids(labelled) == {"b", "c"} and other == 507


def test_a_forgotten_client_frees_its_label_and_other_never_drops() -> None:
    labels = ClientLabels(limit=1)
    assert labels.split(_clients(a=10, b=4, c=3))[1] == 7
    # a forgotten: its label goes to the next new client; b forgotten: its tokens stay in other.
    labelled, other = labels.split(_clients(c=5, d=2))
    assert _ids(labelled) == {"d"} and other == 4 + 5
    # c forgotten and back (fewer served than last seen): still no drop.
    labelled, other = labels.split(_clients(c=1, d=3))
    assert _ids(labelled) == {"d"} and other == 4 + 5 + 1


def test_a_client_named_other_counts_under_other() -> None:
    labelled, other = ClientLabels(limit=5).split(_clients(**{OTHER_CLIENTS: 9, "a": 1}))
    assert _ids(labelled) == {"a"} and other == 9


def _series(metrics: SchedulerMetrics, name: str) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {sample.labels["client"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def test_the_scrape_exports_at_most_the_limit_plus_other() -> None:
    metrics = SchedulerMetrics(max_client_labels=3)
    clients = tuple(ClientCounter(client_id=f"session-{i}", counter=float(i), served_tokens=10 * i)
                    for i in range(1, 11))
    metrics.publish(CoreStats(policy=Policy.VTC, pending=0, prefilling=0, active=0, admitted=0, finished=0,
                              preemptions=0, clients=clients))
    served = _series(metrics, "fairserve_scheduler_client_served_tokens_total")
    assert served == {"session-10": 100.0, "session-9": 90.0, "session-8": 80.0,
                      OTHER_CLIENTS: float(sum(10 * i for i in range(1, 8)))}
    vtc = _series(metrics, "fairserve_scheduler_client_vtc_tokens")
    assert vtc == {"session-10": 10.0, "session-9": 9.0, "session-8": 8.0}
