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


# ---- vLLM as the engine (docs/vllm.md): compose profile `vllm`, k8s engines-vllm.yaml, production-vllm.yaml

VLLM_CONFIG = DEPLOY / "config" / "production-vllm.yaml"
VLLM_ENTRYPOINTS = (["python3", "-m", "vllm.entrypoints.openai.api_server"], ["vllm", "serve"])


def _vllm_engines(compose: dict, k8s_docs: list[dict]) -> dict:
    """``{(where, name): {"argv", "env", "ports", "profiles"}}`` of every container running the vLLM image
    in a compose document and a list of Kubernetes manifests (argv: entrypoint/command + command/args)."""
    out = {}
    for name, svc in compose["services"].items():
        if str(svc.get("image", "")).startswith("vllm/"):
            entry, cmd = svc.get("entrypoint") or [], svc.get("command") or []
            argv = (entry.split() if isinstance(entry, str) else list(entry)) + (
                cmd.split() if isinstance(cmd, str) else list(cmd))
            out["compose", name] = {"argv": [str(a) for a in argv], "profiles": svc.get("profiles") or [],
                                    "env": {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}}
    for doc in k8s_docs:
        for c in ((doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
            if c.get("image", "").startswith("vllm/"):
                out["k8s", doc["metadata"]["name"]] = {
                    "argv": [str(a) for a in (c.get("command") or []) + (c.get("args") or [])],
                    "env": {e["name"]: str(e.get("value")) for e in c.get("env") or []},
                    "ports": [p["containerPort"] for p in c.get("ports") or []]}
    return out


def _flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` ("" for a flag without one), None when absent."""
    if name not in argv:
        return None
    i = argv.index(name)
    return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""


def _vllm_engine_problems(engines: dict) -> list[str]:
    """What is wrong with the vLLM engines: the image's server module (or ``vllm serve``), the dev
    endpoints the syncer and VllmClient need, runtime LoRA on the policy, raw log-probs (recorded as
    temperature 1), an explicit dtype (``auto`` serves an fp32 model in fp16)."""
    problems = []
    for where, e in engines.items():
        argv, env = e["argv"], e["env"]
        if not any(argv[:len(p)] == p for p in VLLM_ENTRYPOINTS):
            problems.append(f"{where}: runs {argv[:3]}, not the api_server module or `vllm serve`")
        if env.get("VLLM_SERVER_DEV_MODE") != "1":
            problems.append(f"{where}: VLLM_SERVER_DEV_MODE=1 missing (/weight_info, weight reload, pause)")
        if _flag(argv, "--logprobs-mode") != "raw_logprobs":
            problems.append(f"{where}: --logprobs-mode is not raw_logprobs (VllmClient records raw log-probs)")
        if _flag(argv, "--dtype") in (None, "", "auto"):
            problems.append(f"{where}: no explicit --dtype")
        if "policy" in where[1] and (env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") != "True"
                                     or _flag(argv, "--enable-lora") != "" or not _flag(argv, "--max-lora-rank")):
            problems.append(f"{where}: runtime LoRA loading is not enabled (tenants' adapters)")
    return problems


def _k8s_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def test_vllm_engines_run_the_server_with_the_endpoints_the_client_needs():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    engines = _vllm_engines(compose, _k8s_docs("engines-vllm.yaml"))
    assert {("compose", "vllm-policy"), ("compose", "vllm-teacher"), ("k8s", "vllm-policy"),
            ("k8s", "vllm-teacher")} <= set(engines)
    assert _vllm_engine_problems(engines) == []
    broken = copy.deepcopy(compose)
    broken["services"]["vllm-policy"]["environment"].pop("VLLM_SERVER_DEV_MODE")
    broken["services"]["vllm-teacher"]["entrypoint"] = ["vllm"]  # the console script the CPU build lacks
    problems = _vllm_engine_problems(_vllm_engines(broken, []))
    assert any("vllm-policy" in p and "DEV_MODE" in p for p in problems), problems
    assert any("vllm-teacher" in p and "api_server" in p for p in problems), problems


def test_vllm_image_is_pinned_to_the_version_the_client_was_measured_on():
    from pipeline.engine_api.vllm import VLLM_VERSION

    vllm = [(where, img) for where, img in _images() if img.startswith("vllm/")]
    vllm += [(f"engines-vllm.yaml:{c['name']}", c["image"]) for d in _k8s_docs("engines-vllm.yaml")
             for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
             if c["image"].startswith("vllm/")]
    assert len(vllm) >= 4
    for where, img in vllm:
        assert img == f"vllm/vllm-openai:v{VLLM_VERSION}", f"{where}: {img} is not vllm-openai v{VLLM_VERSION}"


def _vllm_wiring_problems(config, compose: dict, k8s_docs: list[dict]) -> list[str]:
    """Where production-vllm.yaml's URLs miss the vLLM engines: each URL's host must be a vLLM compose
    service listening (``--port``) on the URL's port and a Kubernetes Service of that port; the
    judge's model must be the teacher's served name."""
    from urllib.parse import urlsplit

    engines = _vllm_engines(compose, k8s_docs)
    services = {d["metadata"]["name"]: [p["port"] for p in d["spec"]["ports"]] for d in k8s_docs
                if d["kind"] == "Service"}
    problems = []
    for key, url in (("engine.url", config.engine.url), ("engine.teacher_url", config.engine.teacher_url),
                     ("judge.url", config.judge.url), ("syncer.engine_url", config.syncer.engine_url)):
        u = urlsplit(url)
        e = engines.get(("compose", u.hostname))
        if e is None or _flag(e["argv"], "--port") != str(u.port):
            problems.append(f"{key} {url}: no vLLM compose service {u.hostname} on port {u.port}")
        if u.port not in services.get(u.hostname, []) or u.port not in engines.get(("k8s", u.hostname), {}).get(
                "ports", []):
            problems.append(f"{key} {url}: no Kubernetes Service/container {u.hostname} on port {u.port}")
    teacher = engines.get(("compose", urlsplit(config.judge.url).hostname), {"argv": []})
    if _flag(teacher["argv"], "--served-model-name") != config.judge.model:
        problems.append(f"judge.model {config.judge.model} is not the teacher's --served-model-name")
    return problems


def test_vllm_config_reaches_the_vllm_engines():
    config = load_config(str(VLLM_CONFIG))
    assert config.engine.kind == "vllm" and (config.engine.teacher_kind or config.engine.kind) == "vllm"
    assert config.judge.backend == "llm" and config.engine.teacher_url != config.engine.url  # a frozen teacher
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    docs = _k8s_docs("engines-vllm.yaml")
    assert _vllm_wiring_problems(config, compose, docs) == []
    broken = copy.deepcopy(compose)
    broken["services"]["vllm-policy"]["command"] = [
        "8001" if a == "8000" else a for a in broken["services"]["vllm-policy"]["command"]]
    problems = _vllm_wiring_problems(config, broken, docs)
    assert any(p.startswith("engine.url") for p in problems) and any(p.startswith("syncer.engine_url")
                                                                     for p in problems), problems


def test_vllm_variant_is_opt_in_and_the_stages_can_switch_to_it():
    """Plain ``docker compose up`` stays SGLang: the vLLM services only run under the ``vllm``
    profile; every stage mounts production-vllm.yaml and reads the file PIPELINE_CONFIG_FILE names
    (default production.yaml); the syncer takes its engine from that config, not a fixed flag."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        image = str(svc.get("image", ""))
        assert (svc.get("profiles") == ["vllm"]) == image.startswith("vllm/"), name
    for name in ("proxy", "judge", "trainer", "syncer", "dashboard"):
        svc = services[name]
        assert svc["environment"]["PIPELINE_CONFIG"] == "/etc/pipeline/${PIPELINE_CONFIG_FILE:-production.yaml}"
        assert "./config/production-vllm.yaml:/etc/pipeline/production-vllm.yaml:ro" in svc["volumes"], name
    assert "--engine" not in services["syncer"]["command"]
    k = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert "engines.yaml" in k["resources"] and "engines-vllm.yaml" not in k["resources"]  # one engine family
    assert "engines-vllm.yaml" in (DEPLOY / "k8s" / "kustomization.yaml").read_text()  # the swap is documented
