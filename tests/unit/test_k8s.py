"""deploy/k8s renders (base, both overlays) and every object validates against
the Kubernetes schemas bundled with kubernetes-validate (offline: no schema
is fetched). tests/unit/kustomize_lite.py does the rendering."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.unit.kustomize_lite import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"
SERVICES = {"gateway": 8000, "scheduler": 50051, "worker": 50061, "kvcache": 50071}
METRICS_PORTS = {"gateway": 9100, "scheduler": 9101, "worker": 9102, "kvcache": 9103}
TARGETS = {"default": K8S, "base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu",
           "tls": K8S / "overlays" / "tls", "keda": K8S / "overlays" / "keda"}
CUSTOM_RESOURCES = {"keda.sh/v1alpha1"}   # CRDs: not in the bundled schemas, checked by their own tests


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    """Validation must never reach the network."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("schema validation tried the network")
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    keyed = {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}
    assert len(keyed) == len(objects), "duplicate objects"
    return keyed


def _container(objects: list[dict], name: str) -> dict:
    (container,) = _by_kind(objects)[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_render_and_validate_against_the_kubernetes_schemas(target: str) -> None:
    objects = render(TARGETS[target])
    kinds = _by_kind(objects)
    for name in [*SERVICES, "redis"]:
        assert ("Deployment", name) in kinds and ("Service", name) in kinds, name
    assert ("HorizontalPodAutoscaler", "gateway") in kinds and ("ConfigMap", "fairserve-config") in kinds
    assert ("PodDisruptionBudget", "gateway") in kinds and ("PodDisruptionBudget", "worker") in kinds
    worker_autoscalers = [obj for obj in objects if obj["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
                          and obj["spec"]["scaleTargetRef"]["name"] == "worker"]
    assert len(worker_autoscalers) == 1     # KEDA's overlay replaces the HPA: never two at once
    for obj in objects:
        if obj["apiVersion"] not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_secret_example_validates_and_holds_no_value() -> None:
    secret = yaml.safe_load((K8S / "base" / "secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert set(secret["stringData"]) == {"internal_token", "worker_token", "redis_password", "api_keys",
                                         "admin_keys"}
    assert all(" " in value for value in secret["stringData"].values())   # rejected by the services as is
    assert not any(obj["kind"] == "Secret" for obj in render(K8S / "base"))   # made with kubectl, never applied


def test_every_service_has_probes_resources_and_scrape_annotations() -> None:
    objects = render(K8S / "base")
    kinds = _by_kind(objects)
    for name, port in SERVICES.items():
        container = _container(objects, name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            if name == "gateway":
                assert spec["httpGet"]["path"] == ("/ready" if probe == "readinessProbe" else "/health")
            else:
                assert spec["grpc"] == {"port": port}, (name, probe)
        assert set(container["resources"]) == {"requests", "limits"}, name
        assert container["envFrom"] == [{"configMapRef": {"name": "fairserve-config"}}]
        annotations = kinds[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORTS[name]),
                               "prometheus.io/path": "/metrics"}, name
        pod = kinds[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert re.fullmatch(rf"fairserve-{name}:\d+\.\d+\.\d+", container["image"]), container["image"]
    assert "replicas" not in kinds[("Deployment", "gateway")]["spec"]        # the HPA owns it
    assert kinds[("HorizontalPodAutoscaler", "gateway")]["spec"]["scaleTargetRef"]["name"] == "gateway"
    assert kinds[("Service", "worker")]["spec"]["clusterIP"] == "None"


def test_secrets_come_from_the_secret_and_each_worker_names_itself() -> None:
    objects = render(K8S / "base")
    config = _by_kind(objects)[("ConfigMap", "fairserve-config")]["data"]
    assert not any(re.search(r"TOKEN$|KEYS?$|PASSWORD|SECRET", key) for key in config if key != "INTERNAL_TOKEN_FILE")
    assert config["INTERNAL_TOKEN_FILE"].startswith("/run/secrets/fairserve/")
    for name in SERVICES:
        pod = _by_kind(objects)[("Deployment", name)]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "fairserve-secrets"
    gateway_env = {e["name"]: e for e in _container(objects, "gateway")["env"]}
    assert gateway_env["API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "fairserve-secrets", "key": "api_keys", "optional": True}
    assert gateway_env["ADMIN_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "fairserve-secrets", "key": "admin_keys", "optional": True}
    worker_env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in _container(objects, "worker")["env"]
                  if "valueFrom" in e}
    assert worker_env == {"WORKER_ID": "metadata.name", "WORKER_ADVERTISE_HOST": "status.podIP"}
    # The workers' token: mounted and named on the scheduler and the workers only.
    for name in SERVICES:
        pod = _by_kind(objects)[("Deployment", name)]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        env = {e["name"]: e.get("value") for e in _container(objects, name).get("env", [])}
        holds = name in ("scheduler", "worker")
        assert ("worker_token" in {item["key"] for item in volume["secret"]["items"]}) is holds, name
        assert env.get("WORKER_TOKEN_FILE") == ("/run/secrets/fairserve/worker_token" if holds else None), name


def test_the_gpu_overlay_gives_each_worker_one_gpu_and_the_cuda_image() -> None:
    cpu, gpu = render(K8S / "overlays" / "cpu"), render(K8S / "overlays" / "gpu")
    worker = _container(gpu, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["image"].endswith("-cuda")
    env = {e["name"]: e for e in worker["env"]}
    assert env["DEVICE"]["value"] == "cuda" and "WORKER_ID" in env        # merged, not replaced
    assert "nvidia.com/gpu" not in _container(cpu, "worker")["resources"]["limits"]
    # Besides the worker, only the gateway's model-init step changes: it runs the worker image,
    # which the overlay retags (the CUDA build converts the model the same way).
    def without_model_init(objects):
        objects = copy.deepcopy([obj for obj in objects if obj["metadata"]["name"] != "worker"])
        for obj in objects:
            for init in obj.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers", []):
                init["image"] = init["image"].removesuffix("-cuda")
        return objects
    assert without_model_init(gpu) == without_model_init(cpu)


def test_prometheus_on_kubernetes_scrapes_pods_by_their_annotations() -> None:
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus-k8s.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    sources = {tuple(rule["source_labels"]): rule for rule in job["relabel_configs"]}
    assert sources[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]["action"] == "keep"
    assert sources[("__meta_kubernetes_pod_annotation_prometheus_io_path",)]["target_label"] == "__metrics_path__"
    port_rule = sources[("__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port")]
    assert re.sub(port_rule["regex"], port_rule["replacement"].replace("$", "\\"), "10.0.0.7:50061;9102") == "10.0.0.7:9102"


def test_the_tls_overlay_probes_through_the_healthcheck_with_the_certificates_mounted() -> None:
    cpu, tls = render(K8S / "overlays" / "cpu"), render(K8S / "overlays" / "tls")
    config = _by_kind(tls)[("ConfigMap", "fairserve-config")]["data"]
    tls_files = {config[name] for name in ("GRPC_TLS_CA", "GRPC_TLS_CERT", "GRPC_TLS_KEY")}
    (directory,) = {path.rsplit("/", 1)[0] for path in tls_files}
    assert config["GRPC_TLS_SERVER_NAME"]                  # workers are dialled by pod IP
    added = set(config) - set(_by_kind(cpu)[("ConfigMap", "fairserve-config")]["data"])
    read = set(re.findall(r'"(GRPC_TLS_[A-Z_]+)"', (ROOT / "common" / "transport" / "internal_auth.py").read_text()))
    assert added == read == {"GRPC_TLS_CA", "GRPC_TLS_CERT", "GRPC_TLS_KEY", "GRPC_TLS_SERVER_NAME"}
    for name in SERVICES:
        container = _container(tls, name)
        pod = _by_kind(tls)[("Deployment", name)]["spec"]["template"]["spec"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "fairserve-grpc-tls" and mount["readOnly"] is True
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            if name == "gateway":                          # HTTP, untouched by internal TLS
                assert spec == _container(cpu, name)[probe]
            else:                                          # one handler: the plaintext grpc probe is gone
                assert "grpc" not in spec and spec["exec"]["command"] == [
                    "python", "-m", "scripts.healthcheck", name], (name, probe)
                assert spec["timeoutSeconds"] > 3          # scripts/healthcheck.py gives up after 3 s
    assert [o for o in tls if o["kind"] != "Deployment" and o["kind"] != "ConfigMap"] == \
        [o for o in cpu if o["kind"] != "Deployment" and o["kind"] != "ConfigMap"]


def test_workers_scale_on_queue_depth_and_drain_before_they_go() -> None:
    kinds = _by_kind(render(K8S))
    hpa = kinds[("HorizontalPodAutoscaler", "worker")]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "fairserve_requests_waiting"
    assert hpa["behavior"]["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]
    worker = kinds[("Deployment", "worker")]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] >= 30     # SIGTERM: the worker hands its requests over
    budget = kinds[("PodDisruptionBudget", "worker")]["spec"]
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": "worker"}}}


def test_the_keda_overlay_scales_workers_on_vllms_waiting_gauge() -> None:
    kinds = _by_kind(render(TARGETS["keda"]))
    assert ("HorizontalPodAutoscaler", "worker") not in kinds
    scaled = kinds[("ScaledObject", "worker")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {"name": "worker"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == "max(vllm:num_requests_waiting)"
    assert float(trigger["metadata"]["threshold"]) > 0


def test_the_model_is_a_volume_filled_at_start_not_part_of_an_image() -> None:
    kinds = _by_kind(render(K8S))
    gateway = kinds[("Deployment", "gateway")]["spec"]["template"]["spec"]
    (init,) = gateway["initContainers"]
    assert init["image"].startswith("fairserve-worker") and init["command"] == ["python", "-m", "common.model_store"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in _container(render(K8S), "gateway")["volumeMounts"]
    assert {"name": "models", "mountPath": "/models"} in _container(render(K8S), "worker")["volumeMounts"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_shards_overlay_runs_a_statefulset_of_schedulers_named_in_the_config() -> None:
    objects = render(K8S / "overlays" / "shards")
    kinds = _by_kind(objects)
    assert ("Deployment", "scheduler") not in kinds
    shards = kinds[("StatefulSet", "scheduler")]["spec"]
    assert shards["serviceName"] == "scheduler" and kinds[("Service", "scheduler")]["spec"]["clusterIP"] == "None"
    single = _by_kind(render(K8S / "overlays" / "cpu"))[("Deployment", "scheduler")]["spec"]
    assert shards["template"] == single["template"]          # the same pod, only more of them
    config = kinds[("ConfigMap", "fairserve-config")]["data"]
    addresses = ",".join(f"scheduler-{i}.scheduler:50051" for i in range(shards["replicas"]))
    assert config["SCHEDULER_SHARDS"] == config["SCHEDULER_PEERS"] == addresses
    assert ("Deployment", "worker") in kinds and ("Deployment", "gateway") in kinds
    for obj in objects:
        if obj["apiVersion"] not in CUSTOM_RESOURCES:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
