"""deploy/kubernetes/: the tensor-parallel and replica manifests lint clean (yamllint), validate against the Kubernetes
API schemas (kubernetes-validate, offline and strict: an unknown field fails) and against the LeaderWorkerSet and
InferencePool CRDs' schemas (vendored in tests/data/), and wire the ranks the way kvserve reads them: each pod's
environment, built as the kubelet builds it, gives `kvserve serve` its rank, the world size it checks and rank 0's
address; the pool sends to the port the replicas listen on.

They are linted here, not applied: no cluster runs in the tests.
"""

import copy
import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from kvserve.engine.parallel.launch import launched_rank, launched_spec
from kvserve.server.settings import ENV_PREFIX, ServerSettings, load_settings

ROOT = Path(__file__).parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
STATEFULSET_FILE = MANIFESTS / "tensor-parallel.yaml"
LWS_FILE = MANIFESTS / "tensor-parallel-lws.yaml"
LWS_SCHEMA_FILE = Path(__file__).parent / "data" / "leaderworkerset-v0.9.0-schema.yaml"
POOL_FILE = MANIFESTS / "replicas-inference-pool.yaml"
POOL_SCHEMA_FILE = Path(__file__).parent / "data" / "inferencepool-v1.6.0-schema.yaml"
# The oldest Kubernetes with the pod-index label on StatefulSet pods, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.28", kubernetes_validate.latest_version()]
YAMLLINT_CONFIG = YamlLintConfig("{extends: default, rules: {line-length: {max: 120}}}")
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
NAMESPACE = "inference"
LWS_VARIABLES = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def statefulset_objects() -> tuple[dict, dict, dict]:
    """The StatefulSet, the headless Service it names, and the Service clients use."""
    objects = documents(STATEFULSET_FILE)
    [statefulset] = [doc for doc in objects if doc["kind"] == "StatefulSet"]
    services = [doc for doc in objects if doc["kind"] == "Service"]
    [headless] = [service for service in services if service["spec"].get("clusterIP") == "None"]
    [client] = [service for service in services if service is not headless]
    return statefulset, headless, client


def leaderworkerset_objects() -> tuple[dict, dict]:
    objects = documents(LWS_FILE)
    [lws] = [doc for doc in objects if doc["kind"] == "LeaderWorkerSet"]
    [client] = [doc for doc in objects if doc["kind"] == "Service"]
    return lws, client


def inference_pool_objects() -> tuple[dict, dict]:
    """The replicas' Deployment and the InferencePool that groups them."""
    objects = documents(POOL_FILE)
    [deployment] = [doc for doc in objects if doc["kind"] == "Deployment"]
    [pool] = [doc for doc in objects if doc["kind"] == "InferencePool"]
    return deployment, pool


def only_container(pod_template: dict) -> dict:
    [container] = pod_template["spec"]["containers"]
    return container


def env_variable(container: dict, name: str) -> dict:
    return next(variable for variable in container["env"] if variable["name"] == name)


def pod_environment(container: dict, injected: dict[str, str], fields: dict[str, str]) -> dict[str, str]:
    """The variables the container sees, built as the kubelet builds them: `injected` first (what a webhook put
    ahead of the container's own), then each variable in order, its `$(NAME)`s expanded from the ones before it
    (an undefined name stays as written) and its `fieldRef` read from the pod's `fields`."""
    environment = dict(injected)
    for variable in container["env"]:
        if "valueFrom" in variable:
            environment[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
            continue
        environment[variable["name"]] = re.sub(
            r"\$\((\w+)\)", lambda match: environment.get(match[1], match[0]), variable["value"]
        )
    return environment


def statefulset_pod_environment(rank: int) -> dict[str, str]:
    statefulset, _, _ = statefulset_objects()
    fields = {"metadata.namespace": NAMESPACE, POD_INDEX_FIELD: str(rank)}
    return pod_environment(only_container(statefulset["spec"]["template"]), {}, fields)


def lws_pod_environment(worker_index: int) -> dict[str, str]:
    """What LeaderWorkerSet v0.9.0's pod webhook injects (pkg/utils/pod AddLWSVariables), for group 0 with the
    default shared subdomain (the LeaderWorkerSet's name), ahead of the template's own variables."""
    lws, _ = leaderworkerset_objects()
    name, group = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    injected = {
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(group["size"]),
        "LWS_WORKER_INDEX": str(worker_index),
    }
    template = group["leaderTemplate"] if worker_index == 0 else group["workerTemplate"]
    return pod_environment(only_container(template), injected, {})


def strict(schema: dict) -> dict:
    """The CRD schema as the API server applies it with strict field validation (kubectl's default): an object
    that lists its properties and keeps no unknown fields refuses the others."""
    if not isinstance(schema, dict):
        return schema
    schema = {key: [strict(item) for item in value] if isinstance(value, list) else strict(value)
              for key, value in schema.items()}  # fmt: skip
    lists_its_fields = "properties" in schema and "additionalProperties" not in schema
    if lists_its_fields and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    return schema


def validate_leaderworkerset(lws: dict) -> None:
    """The LeaderWorkerSet against its CRD schema, and its pod templates against the Kubernetes one."""
    jsonschema.validate(lws, strict(yaml.safe_load(LWS_SCHEMA_FILE.read_text())))
    for role in ("leaderTemplate", "workerTemplate"):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
                        "template": lws["spec"]["leaderWorkerTemplate"][role]}  # fmt: skip
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("path", [STATEFULSET_FILE, LWS_FILE, POOL_FILE], ids=lambda path: path.name)
def test_manifests_are_yamllint_clean(path):
    problems = list(linter.run(path.read_text(), YAMLLINT_CONFIG, str(path)))
    assert problems == [], "\n".join(f"{path.name}:{p.line}:{p.column}: {p.message} ({p.rule})" for p in problems)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_objects_validate_against_the_api_schema(version):
    objects = [*documents(STATEFULSET_FILE), leaderworkerset_objects()[1]]
    assert sorted(doc["kind"] for doc in objects) == ["Service", "Service", "Service", "StatefulSet"]
    for doc in objects:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda spec: spec.update(replica=spec.pop("replicas")),
        lambda spec: spec.update(replicas="2"),
        lambda spec: env_variable(only_container(spec["template"]), "RANK")["valueFrom"].update(fieldref={}),
        lambda spec: only_container(spec["template"])["startupProbe"].update(periodSeconds="10s"),
    ],
    ids=["misspelt-field", "string-for-integer", "misspelt-nested-field", "wrong-type-in-probe"],
)
def test_the_validator_refuses_a_broken_statefulset(break_it):
    statefulset, _, _ = statefulset_objects()
    kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[0], strict=True)
    broken = copy.deepcopy(statefulset)
    break_it(broken["spec"])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_the_leaderworkerset_validates_against_its_crd_schema():
    lws, _ = leaderworkerset_objects()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    validate_leaderworkerset(lws)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda group: group.update(restartPolicy="RecreateGroupOnRestart"),
        lambda group: group.update(sizes=group.pop("size")),
        lambda group: group.update(size="2"),
        lambda group: group.pop("workerTemplate"),
        lambda group: only_container(group["workerTemplate"]).update(imagePullPolicy=1),
    ],
    ids=["unknown-restart-policy", "misspelt-field", "string-for-integer", "no-worker-template", "bad-pod-template"],
)
def test_the_validator_refuses_a_broken_leaderworkerset(break_it):
    lws, _ = leaderworkerset_objects()
    broken = copy.deepcopy(lws)
    break_it(broken["spec"]["leaderWorkerTemplate"])
    with pytest.raises(jsonschema.ValidationError):  # kubernetes-validate's errors are jsonschema's too
        validate_leaderworkerset(broken)


def validate_inference_pool(pool: dict) -> None:
    jsonschema.validate(pool, strict(yaml.safe_load(POOL_SCHEMA_FILE.read_text())))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_replicas_deployment_validates_against_the_api_schema(version):
    deployment, _ = inference_pool_objects()
    kubernetes_validate.validate(deployment, version, strict=True)


def test_the_inference_pool_validates_against_its_crd_schema_and_sends_to_the_replicas_port():
    deployment, pool = inference_pool_objects()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    validate_inference_pool(pool)
    template = deployment["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    container = only_container(template)
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    settings = load_settings(None, {}, environ=environment)
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert [port["number"] for port in pool["spec"]["targetPorts"]] == [settings.port]
    assert [port["containerPort"] for port in container["ports"]] == [settings.port]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize(
    "break_it",
    [
        lambda spec: spec.update(targetPorts=[]),
        lambda spec: spec["targetPorts"][0].update(number="8000"),
        lambda spec: spec["selector"].update(matchLabel=spec["selector"].pop("matchLabels")),
        lambda spec: spec["endpointPickerRef"].update(failureMode="Open"),
        lambda spec: spec["endpointPickerRef"].pop("name"),
    ],
    ids=["no-target-port", "string-for-integer", "misspelt-field", "unknown-failure-mode", "picker-without-name"],
)
def test_the_validator_refuses_a_broken_inference_pool(break_it):
    _, pool = inference_pool_objects()
    broken = copy.deepcopy(pool)
    break_it(broken["spec"])
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool(broken)


def test_every_kvserve_variable_the_manifests_set_is_a_setting():
    containers = [only_container(statefulset_objects()[0]["spec"]["template"])]
    containers.append(only_container(inference_pool_objects()[0]["spec"]["template"]))
    group = leaderworkerset_objects()[0]["spec"]["leaderWorkerTemplate"]
    containers += [only_container(group["leaderTemplate"]), only_container(group["workerTemplate"])]
    names = {variable["name"] for container in containers for variable in container["env"]}
    kvserve_names = {name for name in names if name.startswith(ENV_PREFIX)}
    assert {"KVSERVE_TENSOR_PARALLEL_SIZE", "KVSERVE_MODEL", "KVSERVE_HOST"} <= kvserve_names
    assert {name.removeprefix(ENV_PREFIX).lower() for name in kvserve_names} <= set(ServerSettings.model_fields)


@pytest.mark.parametrize(
    "environment_of",
    [statefulset_pod_environment, lws_pod_environment],
    ids=["statefulset", "leaderworkerset"],
)
def test_each_pod_environment_gives_kvserve_its_rank_and_the_group(environment_of, monkeypatch):
    for rank in range(2):
        environment = environment_of(rank)
        assert {name: value for name, value in environment.items() if "$(" in value} == {}  # all resolved
        settings = load_settings(None, {}, environ=environment)
        assert (settings.tensor_parallel_size, settings.host, settings.port) == (2, "0.0.0.0", 8000)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        assert launched_rank() == rank
        spec = launched_spec(settings.engine_config(), settings.model)  # refuses WORLD_SIZE != tensor_parallel_size
        assert (spec.rank, spec.size, spec.local_rank, spec.init_method) == (rank, 2, 0, "env://")
        assert environment["MASTER_PORT"] == "29500"


def test_the_statefulset_ranks_meet_at_rank_0s_stable_name_and_clients_reach_only_rank_0():
    statefulset, headless, client = statefulset_objects()
    spec = statefulset["spec"]
    assert spec["serviceName"] == headless["metadata"]["name"]
    assert spec["podManagementPolicy"] == "Parallel"  # the ranks wait for each other: not one by one
    assert headless["spec"]["publishNotReadyAddresses"] is True  # rank 0 is not Ready until they have met
    rank_0_name = f"{statefulset['metadata']['name']}-0.{spec['serviceName']}.{NAMESPACE}.svc"
    environments = [statefulset_pod_environment(rank) for rank in range(spec["replicas"])]
    assert {environment["MASTER_ADDR"] for environment in environments} == {rank_0_name}
    assert {environment["WORLD_SIZE"] for environment in environments} == {str(spec["replicas"])}
    assert [port["port"] for port in headless["spec"]["ports"]] == [int(environments[0]["MASTER_PORT"])]

    container = only_container(spec["template"])
    assert env_variable(container, "RANK")["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX_FIELD
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == pod_labels == headless["spec"]["selector"]
    assert client["spec"]["selector"] == {**pod_labels, "apps.kubernetes.io/pod-index": "0"}
    assert_serves_rank_0s_http_port(client, container)
    assert_one_gpu_a_read_only_model_and_the_image_entrypoint(spec["template"])


def test_the_leaderworkerset_recreates_the_group_and_clients_reach_only_the_leader():
    lws, client = leaderworkerset_objects()
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would wait for a leader that waits
    leader, worker = only_container(group["leaderTemplate"]), only_container(group["workerTemplate"])
    assert leader["env"] == worker["env"]
    for container in (leader, worker):
        values = "".join(variable.get("value", "") for variable in container["env"])
        assert set(re.findall(r"\$\((\w+)\)", values)) == LWS_VARIABLES
    assert client["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    assert_serves_rank_0s_http_port(client, leader)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert probe not in worker  # a worker serves no HTTP
    assert "ports" not in worker
    for role in ("leaderTemplate", "workerTemplate"):
        assert_one_gpu_a_read_only_model_and_the_image_entrypoint(group[role])


def assert_serves_rank_0s_http_port(service: dict, container: dict) -> None:
    [service_port] = service["spec"]["ports"]
    [container_port] = container["ports"]
    assert service_port["targetPort"] == container_port["name"]
    assert service_port["port"] == container_port["containerPort"] == ServerSettings.model_fields["port"].default


def assert_one_gpu_a_read_only_model_and_the_image_entrypoint(pod_template: dict) -> None:
    container = only_container(pod_template)
    assert container["image"] == "kvserve:cuda"
    assert "-t kvserve:cuda" in (ROOT / "docker" / "Dockerfile").read_text()
    assert "command" not in container and "args" not in container  # the image's `kvserve serve`
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    [models_mount] = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/models"]
    [models] = [volume for volume in pod_template["spec"]["volumes"] if volume["name"] == models_mount["name"]]
    assert models_mount["readOnly"] is True and models["persistentVolumeClaim"]["readOnly"] is True
    assert env_variable(container, "KVSERVE_MODEL")["value"].startswith("/models/")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_statefulset_probe_asks_rank_0s_health_and_passes_on_a_worker():
    container = only_container(statefulset_objects()[0]["spec"]["template"])
    command = container["startupProbe"]["exec"]["command"]
    assert container["readinessProbe"]["exec"]["command"] == container["livenessProbe"]["exec"]["command"] == command
    assert command[0] == "python" and "127.0.0.1:8000/health" in command[-1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = [sys.executable, *command[1:-1], command[-1].replace(":8000/", f":{server.server_port}/")]

    def probe(rank: int, health_status: int) -> int:
        _Health.status = health_status
        return subprocess.run(local, env={"RANK": str(rank)}, capture_output=True, timeout=30).returncode

    try:
        assert probe(rank=0, health_status=200) == 0
        assert probe(rank=0, health_status=503) != 0
        assert probe(rank=1, health_status=503) == 0  # a worker has no /health to ask
    finally:
        server.shutdown()
        server.server_close()
