"""deploy/helm/fairserve: the chart's values validate against its
values.schema.json, which refuses bad ones; the templates reference only
values that exist and helpers that are defined, with balanced blocks; the
chart carries deploy/k8s's hardening and the objects issue 41 asks for; its
copies of the rules and dashboard match monitoring/.

`helm template` renders the chart with the helm binary of the `helm-binary`
package (requirements.txt: it lands beside the venv's python) or one on PATH."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "fairserve"
TEMPLATES = CHART / "templates"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
OPEN = re.compile(r"\{\{-?\s*(if|range|with|define)\b")
END = re.compile(r"\{\{-?\s*end\s*-?\}\}")
VALUE_PATH = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
INCLUDE = re.compile(r'include\s+"([^"]+)"')
DEFINE = re.compile(r'define\s+"([^"]+)"')


def template_texts() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(TEMPLATES.iterdir())}


def test_the_default_values_match_the_schema() -> None:
    jsonschema.validate(VALUES, SCHEMA)


@pytest.mark.parametrize(("path", "value"), [
    (("worker", "replicas"), 0),
    (("worker", "autoscaling", "mode"), "magic"),
    (("worker", "gpu"), -1),
    (("config", "INTERNAL_TOKEN"), "a secret in a ConfigMap"),
    (("image", "pullPolicy"), "Sometimes"),
    (("gateway", "unknown"), 1),
    (("existingSecret",), ""),
])
def test_the_schema_refuses_bad_values(path, value) -> None:
    values = json.loads(json.dumps(VALUES))
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, SCHEMA)


def test_templates_use_only_existing_values_and_defined_helpers_with_balanced_blocks() -> None:
    texts = template_texts()
    defined = {name for text in texts.values() for name in DEFINE.findall(text)}
    for name, text in texts.items():
        assert len(OPEN.findall(text)) == len(END.findall(text)), name
        for include in INCLUDE.findall(text):
            assert include in defined, (name, include)
        for path in VALUE_PATH.findall(text):
            node = VALUES
            for key in path.strip(".").split("."):
                assert isinstance(node, dict) and key in node, (name, path)
                node = node[key]


def test_the_chart_has_every_object_the_issue_asks_for() -> None:
    kinds = re.findall(r"^kind:\s*(\w+)", "\n".join(template_texts().values()), re.MULTILINE)
    for kind in ("Deployment", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget",
                 "HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor", "PrometheusRule", "Ingress"):
        assert kind in kinds, kind
    assert kinds.count("Deployment") == 4      # and the scheduler's, a StatefulSet with shards:
    assert "kind: {{ if $sharded }}StatefulSet{{ else }}Deployment{{ end }}" in template_texts()["scheduler.yaml"]
    autoscaler = (TEMPLATES / "worker-autoscaler.yaml").read_text()
    assert autoscaler.count("name: worker\n") >= 2 and "vllm:num_requests_waiting" in autoscaler


def test_the_chart_keeps_the_k8s_hardening() -> None:
    texts = template_texts()
    for service in ("gateway", "scheduler", "kvcache", "worker"):
        text = texts[f"{service}.yaml"]
        assert 'include "fairserve.podSecurity"' in text and 'include "fairserve.containerSecurity"' in text
    helpers = texts["_helpers.tpl"]
    for needle in ("runAsNonRoot: true", "readOnlyRootFilesystem: true", "allowPrivilegeEscalation: false",
                   "RuntimeDefault", "- ALL", "automountServiceAccountToken: false"):
        assert needle in helpers, needle
    holders = {name for name, text in texts.items() if "worker_token" in text}
    assert holders == {"scheduler.yaml", "worker.yaml"}
    holders = {name for name, text in texts.items() if "redis_password" in text}
    assert holders == {"kvcache.yaml", "redis.yaml"}
    policies = yaml.safe_load_all("\n".join(line for line in texts["networkpolicy.yaml"].splitlines()
                                            if not line.startswith("{{")))
    k8s = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "networkpolicy.yaml").read_text())
    assert [p for p in policies if p] == [p for p in k8s if p]
    assert "kind: Secret\n" not in "\n".join(texts.values())     # the Secret is never the chart's


def test_the_charts_files_are_the_monitoring_ones() -> None:
    assert (CHART / "files" / "fairserve.rules.yml").read_text() == \
        (ROOT / "monitoring" / "rules" / "fairserve.rules.yml").read_text()
    assert (CHART / "files" / "fairserve.json").read_text() == \
        (ROOT / "monitoring" / "grafana" / "dashboards" / "fairserve.json").read_text()


@pytest.mark.skipif(HELM is None, reason="no helm binary (requirements.txt installs helm-binary)")
@pytest.mark.parametrize("mode", ["hpa", "keda"])
def test_helm_template_renders_valid_objects(mode: str) -> None:
    import kubernetes_validate

    rendered = subprocess.run([HELM, "template", "fairserve", str(CHART), "--set", f"worker.autoscaling.mode={mode}",
                               "--set", "monitoring.serviceMonitor=true", "--set", "monitoring.prometheusRule=true",
                               "--set", "ingress.enabled=true"], capture_output=True, text=True, check=True).stdout
    objects = [obj for obj in yaml.safe_load_all(rendered) if obj]
    kinds = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    assert ("PodDisruptionBudget", "worker") in kinds and ("NetworkPolicy", "worker") in kinds
    assert (("ScaledObject" if mode == "keda" else "HorizontalPodAutoscaler"), "worker") in kinds
    for obj in objects:
        if obj["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            continue
        kubernetes_validate.validate(obj, "1.30", strict=True)


@pytest.mark.skipif(HELM is None, reason="no helm binary (requirements.txt installs helm-binary)")
def test_scheduler_shards_render_a_statefulset_named_in_the_config() -> None:
    import kubernetes_validate

    def render(*values: str) -> dict[tuple[str, str], dict]:
        args = [arg for value in values for arg in ("--set", value)]
        text = subprocess.run([HELM, "template", "fairserve", str(CHART), *args], capture_output=True, text=True,
                              check=True).stdout
        return {(obj["kind"], obj["metadata"]["name"]): obj for obj in yaml.safe_load_all(text) if obj}

    single, sharded = render(), render("scheduler.shards=3")
    assert ("Deployment", "scheduler") in single and "SCHEDULER_SHARDS" not in \
        single[("ConfigMap", "fairserve-config")]["data"]
    assert ("Deployment", "scheduler") not in sharded
    shards = sharded[("StatefulSet", "scheduler")]
    assert shards["spec"]["replicas"] == 3 and shards["spec"]["serviceName"] == "scheduler"
    assert shards["spec"]["template"] == single[("Deployment", "scheduler")]["spec"]["template"]
    assert sharded[("Service", "scheduler")]["spec"]["clusterIP"] == "None"
    config = sharded[("ConfigMap", "fairserve-config")]["data"]
    addresses = "scheduler-0.scheduler:50051,scheduler-1.scheduler:50051,scheduler-2.scheduler:50051"
    assert config["SCHEDULER_SHARDS"] == config["SCHEDULER_PEERS"] == addresses
    for obj in sharded.values():
        if not obj["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            kubernetes_validate.validate(obj, "1.30", strict=True)
    refused = subprocess.run([HELM, "template", "fairserve", str(CHART), "--set", "scheduler.shards=0"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "shards" in refused.stderr


@pytest.mark.skipif(HELM is None, reason="no helm binary (requirements.txt installs helm-binary)")
def test_helm_lints_the_chart_and_refuses_values_its_schema_refuses() -> None:
    lint = subprocess.run([HELM, "lint", str(CHART)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    refused = subprocess.run([HELM, "template", "fairserve", str(CHART), "--set", "worker.replicas=0"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "worker.replicas" in refused.stderr
