"""The console's files as the server serves them (no browser here: see test_console_browser.py): where they are,
their headers, `--no-console` and the API key (test_packaging.py checks the wheel carries them)."""

import re

import httpx
import pytest

from kvserve.server.console import SECURITY_HEADERS, STATIC_DIR
from tests.server_harness import tiny_server

API_KEY = "console-key"


def _referenced_files(index_html: str, scripts: dict[str, str]) -> set[str]:
    """The files index.html links and the modules each script imports, by name."""
    names = set(re.findall(r'(?:src|href)="([\w.-]+\.(?:js|css))"', index_html))
    for source in scripts.values():
        names |= set(re.findall(r'from "\./([\w.-]+\.js)"', source))
    return names


@pytest.fixture(scope="module")
def console_server(tiny_checkpoints):
    with tiny_server(tiny_checkpoints) as running:
        yield running


def test_the_root_redirects_to_the_console_and_every_file_it_loads_is_served(console_server):
    with httpx.Client(base_url=console_server.base_url, timeout=10) as client:
        root = client.get("/")
        assert root.status_code == 307 and root.headers["location"] == "/console/"
        index = client.get("/console/")
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
        scripts = {path.name: path.read_text() for path in STATIC_DIR.glob("*.js")}
        referenced = _referenced_files(index.text, scripts)
        assert referenced == {path.name for path in STATIC_DIR.glob("*") if path.suffix in (".js", ".css")}
        for name in referenced:
            response = client.get(f"/console/{name}")
            assert response.status_code == 200, name
            expected_type = "text/javascript" if name.endswith(".js") else "text/css"
            assert response.headers["content-type"].startswith(expected_type), name
            assert response.text == (STATIC_DIR / name).read_text()


def test_console_files_forbid_foreign_scripts_and_framing(console_server):
    response = httpx.get(f"{console_server.base_url}/console/", timeout=10)
    for header, value in SECURITY_HEADERS.items():
        assert response.headers[header] == value
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "<script>" not in response.text and "http" not in re.sub(r"<!doctype html>", "", response.text, flags=re.I)


@pytest.mark.parametrize("path", ["/console/../server/app.py", "/console/%2e%2e/pyproject.toml", "/console/nope.js"])
def test_nothing_outside_the_console_files_is_served(console_server, path):
    response = httpx.get(f"{console_server.base_url}{path}", timeout=10)
    assert response.status_code == 404


def test_with_an_api_key_the_pages_load_but_their_data_needs_the_key(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, api_key=API_KEY) as running, httpx.Client(base_url=running.base_url) as client:
        assert client.get("/console/").status_code == 200  # no data in it; a browser cannot send the key here
        assert client.get("/v1/engine/state").status_code == 401
        assert client.get("/v1/engine/state", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_no_console_serves_no_pages_and_the_api_as_before(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, console=False) as running, httpx.Client(base_url=running.base_url) as client:
        assert client.get("/").status_code == 404
        assert client.get("/console/").status_code == 404
        assert client.get("/console/app.js").status_code == 404
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/engine/state").status_code == 200  # the endpoint is API, not console


def test_the_no_console_flag_and_setting_reach_the_server_settings():
    from kvserve.server.cli import _parse_args
    from kvserve.server.settings import ServerSettings, load_settings

    assert ServerSettings().console is True
    args = _parse_args(["serve", "--no-console"])
    assert load_settings(None, {"console": args.console}, environ={}).console is False
    assert load_settings(None, {}, environ={"KVSERVE_CONSOLE": "false"}).console is False
