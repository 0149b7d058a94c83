"""deploy/ stays generated from topics.yaml and is valid by its schemas, offline: the compose file
against the Compose specification (the copy vendored in check-jsonschema), the Kubernetes manifests
strictly against the Kubernetes API schemas (kubernetes-validate; unknown fields are errors). Both
checks are shown to fail on a broken file. Images are pinned to versions, never ``latest``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import copy
import json
import re
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.cli import COMMANDS
from pipeline.config import load_config
from pipeline.topics import load_topics, render

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _specs():
    return load_topics(ROOT / "topics.yaml")


def test_strimzi_topics_equal_topics_yaml():
    committed = (DEPLOY / "k8s" / "topics.yaml").read_text()
    assert committed == render(_specs(), "strimzi", replication_factor=3), \
        "deploy/k8s/topics.yaml is stale: pipeline topics render --format strimzi --replication-factor 3"
    docs = list(yaml.safe_load_all(committed))
    by_name = {d["spec"]["topicName"]: d["spec"] for d in docs}
    for s in _specs():
        assert by_name[s.name]["partitions"] == s.partitions
        assert by_name[s.name]["config"] == s.config


def test_compose_topic_job_equals_topics_yaml():
    script = (DEPLOY / "topics.sh").read_text()
    assert script == render(_specs(), "kafka-cli"), \
        "deploy/topics.sh is stale: pipeline topics render --format kafka-cli -o deploy/topics.sh"
    for s in _specs():
        line = next(ln for ln in script.splitlines() if f"--topic {s.name} " in ln)
        assert f"--partitions {s.partitions} " in line
        for k, v in s.config.items():
            assert f"--config {k}={v}" in line
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    job = compose["services"]["topics"]
    assert job["command"] == ["sh", "/deploy/topics.sh"] and "./topics.sh:/deploy/topics.sh:ro" in job["volumes"]


def test_compose_parses_and_uses_real_commands():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kafka", "topics", "sglang-policy", "sglang-judge", "proxy", "judge", "trainer", "syncer"} <= set(services)
    for name in ("proxy", "judge", "trainer", "syncer", "dashboard"):
        assert services[name]["command"][0] in COMMANDS, f"{name} runs an unknown command"
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft
    assert all("healthcheck" in services[s] for s in ("kafka", "sglang-policy", "sglang-judge", "proxy"))
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        r = subprocess.run([docker, "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_production_config_loads():
    c = load_config(str(DEPLOY / "config" / "production.yaml"))
    assert c.kafka.session_timeout_ms >= 6000  # Apache Kafka's group.min.session.timeout.ms
    assert c.judge.backend == "llm" and c.engine.url.startswith("http://sglang")


@pytest.mark.parametrize("path", sorted((DEPLOY / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_manifests_parse(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for d in docs:
        assert "kind" in d and ("metadata" in d or d["kind"] == "Kustomization")
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if c["image"].startswith("openclaw-pipeline"):
                assert c["args"][0] in COMMANDS


K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate==1.37.0 bundles
#: custom resources (operators' CRDs: no schema in the Kubernetes API) and kustomize's own file
CUSTOM_KINDS = {("kafka.strimzi.io/v1beta2", "Kafka"), ("kafka.strimzi.io/v1beta2", "KafkaNodePool"),
                ("kafka.strimzi.io/v1beta2", "KafkaTopic"), ("keda.sh/v1alpha1", "ScaledObject"),
                ("kustomize.config.k8s.io/v1beta1", "Kustomization")}


def _compose_validator():
    import check_jsonschema

    path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _compose_errors(doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _compose_validator().iter_errors(doc)]


def test_compose_file_is_valid_by_the_compose_specification():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert _compose_errors(doc) == []
    broken = copy.deepcopy(doc)
    broken["services"]["proxy"]["restart_policy"] = "always"  # not a service key
    broken["services"]["judge"]["depends_on"] = 5  # must be a list or a map
    errors = _compose_errors(broken)
    assert any("restart_policy" in e for e in errors) and any("judge/depends_on" in e for e in errors), errors


def _manifests():
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            yield pytest.param(doc, id=f"{path.name}#{i}-{doc.get('kind')}")


@pytest.mark.parametrize("doc", _manifests())
def test_k8s_manifest_is_valid_by_the_kubernetes_api_schema(doc):
    if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_KINDS:
        assert doc["kind"] == "Kustomization" or doc["metadata"]["name"]
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_k8s_strict_validation_rejects_unknown_and_mistyped_fields():
    deployment = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "proxy.yaml").read_text())
                      if d and d["kind"] == "StatefulSet")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


def test_proxy_event_buffer_is_on_a_persistent_volume():
    """The proxy's durable event buffer must outlive its container: a named volume in compose,
    a per-pod PersistentVolumeClaim (StatefulSet) in Kubernetes, at the configured buffer_dir."""
    prod = yaml.safe_load((DEPLOY / "config" / "production.yaml").read_text())
    path = prod["proxy"]["buffer_dir"]
    assert path.startswith("/")
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["proxy"]["volumes"]
    named = [m.split(":")[0] for m in mounts if m.split(":")[1] == path]
    assert named and named[0] in compose["volumes"]
    sts = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "proxy.yaml").read_text())
               if d and d["kind"] == "StatefulSet")
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounted = {m["name"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
               if m["mountPath"] == path}
    assert mounted and mounted <= claims


def test_kustomization_lists_existing_files():
    k = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for res in k["resources"]:
        assert (DEPLOY / "k8s" / res).is_file(), res
    for gen in k.get("configMapGenerator", []):
        for f in gen["files"]:
            assert (DEPLOY / "k8s" / f.split("=", 1)[-1]).is_file(), f


def _images():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if "image" in svc:
            yield f"compose:{name}", svc["image"]
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            for c in ((d or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
                yield f"{path.name}:{c['name']}", c["image"]


def test_sglang_image_is_pinned_to_a_version_the_package_supports():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = next(r for r in pyproject["project"]["optional-dependencies"]["gpu"] if r.startswith("sglang"))
    need = tuple(int(x) for x in floor.split(">=")[1].split("."))
    sglang = [(where, img) for where, img in _images() if img.startswith("lmsysorg/sglang")]
    assert len(sglang) >= 3
    for where, img in sglang:
        m = re.fullmatch(r"lmsysorg/sglang:v(\d+)\.(\d+)\.(\d+)(-[a-z0-9]+)?", img)
        assert m, f"{where}: {img} is not pinned to a release"
        assert tuple(int(x) for x in m.groups()[:3]) >= need, f"{where}: {img} is older than {floor}"
    for where, img in _images():
        if not img.startswith("openclaw-pipeline"):  # our own image is built from deploy/Dockerfile
            assert ":" in img and not img.endswith(":latest"), f"{where}: {img} is not pinned"


def _sglang_env():
    """``{(file, service): environment}`` of every SGLang engine in the compose file and the
    Kubernetes manifests."""
    out = {}
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if "sglang" in str(svc.get("image", "")):
            out["compose", name] = {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}
    for doc in yaml.safe_load_all((DEPLOY / "k8s" / "engines.yaml").read_text()):
        for c in ((doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
            if "sglang" in c.get("image", ""):
                out["k8s", doc["metadata"]["name"]] = {e["name"]: str(e.get("value")) for e in c.get("env") or []}
    return out


def test_every_sglang_engine_reports_temperature_scaled_log_probs():
    """Issue 24 case 1: the teacher (and the policy, whose log-probs are recorded) must be started
    with SGLANG_TEMP_SCALED_LOGPROBS=1, or prompt log-probs ignore the requested temperature."""
    envs = _sglang_env()
    assert {("compose", "sglang-judge"), ("compose", "sglang-policy"), ("k8s", "sglang-judge"),
            ("k8s", "sglang-policy")} <= set(envs)
    for where, env in envs.items():
        assert env.get("SGLANG_TEMP_SCALED_LOGPROBS") == "1", where
    config = load_config(DEPLOY / "config" / "production.yaml")
    assert config.engine.teacher_url and config.engine.teacher_url != config.engine.url  # a frozen, named teacher
