"""deploy/k8s locked down: every pod (all overlays) runs as non-root with a
read-only root filesystem, seccomp RuntimeDefault, no privilege escalation,
no capabilities and no service-account token, with emptyDirs where it writes;
Redis requires the Secret's password, which only the kvcache holds; and the
NetworkPolicies allow exactly the paths the architecture draws (checked by
evaluating them over every pair of pods and ports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.kustomize_lite import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TARGETS = {"default": K8S, "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu",
           "tls": K8S / "overlays" / "tls"}
FAIRSERVE = ("gateway", "scheduler", "worker", "kvcache")
NAMESPACE = "fairserve"
NAME = "app.kubernetes.io/name"


def deployments(objects: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_runs_locked_down(target: str) -> None:
    for name, deployment in deployments(render(TARGETS[target])).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["runAsNonRoot"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"] == {"drop": ["ALL"]}, name
            assert "privileged" not in context, name
            mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
            writable = ["/tmp", *(["/home/fairserve/.cache"] if name in FAIRSERVE else ["/data"])]
            for path in writable:
                assert volumes[mounts[path]] == {"name": mounts[path], "emptyDir": {}}, (name, path)


def test_redis_requires_the_password_only_the_kvcache_holds() -> None:
    pods = {name: d["spec"]["template"]["spec"] for name, d in deployments(render(K8S)).items()}
    (redis,) = pods["redis"]["containers"]
    assert "args" not in redis
    shell, flag, script = redis["command"]
    assert (shell, flag) == ("sh", "-c") and "requirepass %s" in script and '"$REDISCLI_AUTH"' in script
    assert "exec redis-server /tmp/redis.conf" in script    # the file, not argv, holds it
    (auth,) = redis["env"]
    assert auth["name"] == "REDISCLI_AUTH" and auth["valueFrom"]["secretKeyRef"] == {
        "name": "fairserve-secrets", "key": "redis_password"}
    assert "PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])   # NOAUTH fails it
    (kvcache,) = pods["kvcache"]["containers"]
    env = {entry["name"]: entry for entry in kvcache["env"]}
    path = env["KV_INDEX_REDIS_PASSWORD_FILE"]["value"]
    directory, file = path.rsplit("/", 1)
    mount = next(m for m in kvcache["volumeMounts"] if m["mountPath"] == directory)
    volume = next(v for v in pods["kvcache"]["volumes"] if v["name"] == mount["name"])
    assert {"key": "redis_password", "path": file} in volume["secret"]["items"]
    for name in ("gateway", "scheduler", "worker"):
        spec = pods[name]
        keys = [item["key"] for v in spec["volumes"] if "secret" in v for item in v["secret"]["items"]]
        assert "redis_password" not in keys, name
        assert "redis_password" not in str(spec["containers"][0].get("env", [])), name


# ---- NetworkPolicies, evaluated ----

Pod = tuple[str, str, dict[str, str]]   # (name, namespace, labels)
EXTERNAL: list[Pod] = [
    ("client", "ingress-nginx", {NAME: "ingress-nginx"}),
    ("prometheus", "monitoring", {NAME: "prometheus"}),
    ("kube-dns", "kube-system", {"k8s-app": "kube-dns"}),
    ("intruder", NAMESPACE, {NAME: "intruder"}),   # another app's pod in the same namespace
]
NAMESPACE_LABELS = {ns: {"kubernetes.io/metadata.name": ns}
                    for ns in (NAMESPACE, "ingress-nginx", "monitoring", "kube-system")}
EXPECTED = {
    *((source[0], "gateway", port) for source in EXTERNAL for port in (8000, 50050)),  # public
    ("prometheus", "gateway", 9100), ("prometheus", "scheduler", 9101),
    ("prometheus", "worker", 9102), ("prometheus", "kvcache", 9103),
    ("gateway", "scheduler", 50051), ("gateway", "kvcache", 50071),
    ("scheduler", "worker", 50061), ("scheduler", "kvcache", 50071),
    ("worker", "scheduler", 50051), ("worker", "kvcache", 50071),
    ("kvcache", "redis", 6379),
    *((name, "kube-dns", 53) for name in (*FAIRSERVE, "redis")),
}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector       # what the manifests use
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def peer_matches(peer: dict[str, Any], policy_namespace: str, pod: Pod) -> bool:
    _name, namespace, labels = pod
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], NAMESPACE_LABELS[namespace]):
            return False
    elif namespace != policy_namespace:
        return False
    return matches(peer.get("podSelector", {}), labels)


def rule_allows(rule: dict[str, Any], peers_key: str, peer: Pod, port: int) -> bool:
    peers = rule.get(peers_key)
    if peers is not None and not any(peer_matches(p, NAMESPACE, peer) for p in peers):
        return False
    ports = rule.get("ports")
    return ports is None or any(entry["port"] == port for entry in ports)


def direction_allows(policies: list[dict], kind: str, pod: Pod, peer: Pod, port: int) -> bool:
    """Whether `kind` (Ingress or Egress) traffic of `pod` with `peer` on `port` is allowed."""
    if pod[1] != NAMESPACE:
        return True                                   # no policy of ours selects it
    selecting = [p["spec"] for p in policies if matches(p["spec"]["podSelector"], pod[2])
                 and kind in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    return any(rule_allows(rule, peers_key, peer, port)
               for spec in selecting for rule in spec.get(key) or [])


def allowed_paths(objects: list[dict]) -> set[tuple[str, str, int]]:
    policies = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    ours: list[Pod] = [(name, NAMESPACE, d["spec"]["template"]["metadata"]["labels"])
                       for name, d in deployments(objects).items()]
    ports = {name: [port["containerPort"] for c in d["spec"]["template"]["spec"]["containers"]
                    for port in c.get("ports", [])] for name, d in deployments(objects).items()}
    ports["kube-dns"] = [53]
    ports.update({name: [8000, 443] for name in ("client", "prometheus", "intruder")})
    allowed = set()
    for source in [*ours, *EXTERNAL]:
        for target in [*ours, *EXTERNAL]:
            if source is target or (source in EXTERNAL and target in EXTERNAL):
                continue
            for port in ports[target[0]]:
                if (direction_allows(policies, "Egress", source, target, port)
                        and direction_allows(policies, "Ingress", target, source, port)):
                    allowed.add((source[0], target[0], port))
    return allowed


@pytest.mark.parametrize("target", TARGETS)
def test_network_policies_allow_exactly_the_architecture(target: str) -> None:
    objects = render(TARGETS[target])
    assert allowed_paths(objects) == EXPECTED


def test_scheduler_shards_may_read_one_another_and_nothing_more() -> None:
    """Two scheduler pods (the shards overlay's StatefulSet): each may call the other's gRPC
    port (SCHEDULER_PEERS), not its metrics port (Prometheus only)."""
    objects = render(K8S / "overlays" / "shards")
    policies = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    (shards,) = [obj for obj in objects if obj["kind"] == "StatefulSet"]
    labels = shards["spec"]["template"]["metadata"]["labels"]
    first, second = ("scheduler-0", NAMESPACE, labels), ("scheduler-1", NAMESPACE, labels)
    assert direction_allows(policies, "Egress", first, second, 50051)
    assert direction_allows(policies, "Ingress", second, first, 50051)
    assert not direction_allows(policies, "Ingress", second, first, 9101)


def test_the_default_deny_covers_every_fairserve_pod() -> None:
    objects = render(K8S)
    (deny,) = [o for o in objects if o["kind"] == "NetworkPolicy"
               and o["metadata"]["name"] == "fairserve-default-deny"]
    assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
    for name, deployment in deployments(objects).items():
        assert matches(deny["spec"]["podSelector"], deployment["spec"]["template"]["metadata"]["labels"]), name
    # Without the policies, everything would be open: the evaluator sees the difference.
    assert len(allowed_paths([o for o in objects if o["kind"] != "NetworkPolicy"])) > 3 * len(EXPECTED)
