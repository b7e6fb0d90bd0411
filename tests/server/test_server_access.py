"""Who may call the server and what it writes down: the Origin allow-list and the Host
check (pages of other sites, DNS rebinding), the API key kept out of the access log and
out of the dashboard's URLs, and /metrics labels that probing cannot multiply. On a
tiny model."""

import json
import logging
import re

import httpx
import pytest

from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import Running, wait_until
from pyllama_paged.cli import build_parser, serve_config
from pyllama_paged.server.app import ORIGINS_ENV, create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.server.config import ServeConfig

M = "tiny"
KEY = "sekrit-dashboard-key"
GENERATE = json.dumps({"model": M, "prompt": "hi", "stream": False, "options": {"num_predict": 1}})


TINY = True
APP = {"origins": ["https://*.example.org"]}


def _post_as_page(url, origin, path="/api/generate"):
    # what a browser page may send anywhere without a preflight: a text/plain POST
    return httpx.post(url + path, content=GENERATE, timeout=60,
                      headers={"Origin": origin, "Content-Type": "text/plain"})


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost.evil.example", "null",
                                    "http://localhost:80.evil.example", "https://example.org.evil.example"])
def test_pages_of_other_sites_are_refused(server, origin):
    # A key-less local server took text/plain bodies from any page (rewritten to JSON)
    before = server.app.state.pp.metrics.prompt_tokens
    r = _post_as_page(server.url, origin)
    assert r.status_code == 403 and "--origins" in r.json()["error"], r.text
    assert server.app.state.pp.metrics.prompt_tokens == before   # nothing was generated
    assert httpx.get(server.url + "/api/tags", headers={"Origin": origin}).status_code == 403
    preflight = httpx.options(server.url + "/api/chat", headers={"Origin": origin,
                                                                 "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403


@pytest.mark.parametrize("origin", ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8443",
                                    "http://0.0.0.0:5173", "app://obsidian.md", "tauri://localhost",
                                    "file://", "vscode-webview://abc", "chrome-extension://abcdef",
                                    "https://app.example.org"])
def test_allowed_origins_are_served_with_cors(server, origin):
    r = _post_as_page(server.url, origin)
    assert r.status_code == 200 and r.json()["done"], r.text
    assert r.headers["access-control-allow-origin"] == origin
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]


def test_clients_without_an_origin_still_post_json_as_text(server):
    # curl -d sends a form content type: Ollama's own examples rely on it being read as JSON
    r = httpx.post(server.url + "/api/generate", content=GENERATE, timeout=60,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("host, status", [
    ("evil.example", 403), ("evil.example:11434", 403), ("192.168.1.5:80", 403), ("localhost.evil.example", 403),
    ("localhost", 200), ("localhost:1234", 200), ("127.0.0.1:9", 200), ("[::1]:80", 200), ("127.0.0.2", 200),
    ("app.localhost:8080", 200),
])
def test_dns_rebinding_is_refused_on_a_loopback_address(server, host, status):
    # a page whose name was rebound to 127.0.0.1 is same-origin to itself: it can read answers
    r = httpx.get(server.url + "/api/tags", headers={"Host": host})
    assert r.status_code == status, r.text


def test_any_host_is_served_when_bound_beyond_loopback(registry):
    s = Running(create_app(registry, Limits(), host="0.0.0.0"))
    try:
        assert httpx.get(s.url + "/api/tags", headers={"Host": "my-box.lan:11434"}).status_code == 200
        assert httpx.get(s.url + "/api/tags", headers={"Origin": "http://evil.example"}).status_code == 403
    finally:
        s.close()


def test_origins_option_and_environment_add_to_the_defaults(monkeypatch):
    monkeypatch.setenv(ORIGINS_ENV, "https://a.test, https://*.b.test")
    origins = serve_config(build_parser().parse_args(["serve", "--origins", "http://c.test:*"])).origins
    assert origins == ("https://a.test", "https://*.b.test", "http://c.test:*")


def test_api_key_in_a_query_stays_out_of_the_access_log(registry):
    s = Running(create_app(registry, Limits(), api_key=KEY))
    lines = []
    catch = logging.Handler()
    catch.emit = lambda record: lines.append(record.getMessage())
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.setLevel(logging.INFO)
    access.addHandler(catch)
    # other packages the suite imports (litellm) put redaction filters of their own on this
    # logger: only ours may act here
    foreign = [f for f in access.filters if not type(f).__module__.startswith("pyllama_paged")]
    for f in foreign:
        access.removeFilter(f)
    try:
        assert httpx.get(s.url + "/api/tags", params={"key": KEY}).status_code == 200
        assert httpx.get(s.url + f"/api/pool?model={M}&key={KEY}").status_code == 200
        wait_until(lambda: len([line for line in lines if "/api/pool" in line]) >= 1, what="the access log line")
        assert all(KEY not in line for line in lines), lines
        assert sum("key=<redacted>" in line for line in lines) >= 2, lines
    finally:
        for f in foreign:
            access.addFilter(f)
        access.removeHandler(catch)
        access.setLevel(level)
        s.close()


def test_health_answers_probes_without_the_key_and_nothing_else_does(registry):
    # routers and Kubernetes probes carry no key: a 401 would mark a healthy server dead
    s = Running(create_app(registry, Limits(), api_key=KEY))
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.head(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/health").content == b""   # says nothing but "can take work"
        for method, path in [("POST", "/health"), ("GET", "/health/"), ("GET", "/api/tags"), ("GET", "/metrics"),
                             ("POST", "/reset_prefix_cache"), ("GET", "/v1/models")]:
            assert httpx.request(method, s.url + path).status_code == 401, (method, path)
        assert httpx.get(s.url + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        s.close()


def test_dashboard_sends_the_key_in_a_header(server):
    # it polled /api/pool?key=... twice a second, each poll a line in the access log
    page = httpx.get(server.url + "/dashboard").text
    assert "X-API-Key" in page and '"?key="' not in page and "replaceState" in page


_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*'
                     r'(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:\\[\\"n]|[^"\\\n])*"'
                     r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:\\[\\"n]|[^"\\\n])*")*\})? (\S+)$')


def test_metrics_label_routes_by_template_and_escape_values(tmp_path):
    # Every GET /v1/models/<anything> added a series with the raw path as its label, unescaped
    name = 'we"ird\\name'
    path = write_tiny_model(tmp_path / f"{name}.gguf", "gemma3", weight_type="q8_0")
    reg = ModelRegistry([path], ServeConfig.flat(n_ctx=256, n_threads=2, n_batch=64, kv_budget_tokens=1024))
    s = Running(create_app(reg, Limits()))
    try:
        for i in range(30):
            assert httpx.get(s.url + f"/v1/models/probe-{i}").status_code == 404
        assert httpx.get(s.url + '/v1/models/a"b\\c').status_code == 404
        assert httpx.get(s.url + "/v1/models/" + name).status_code == 200
        text = httpx.get(s.url + "/metrics").text
        assert 'pyllama_requests_total{route="/v1/models/{model}",status="404"} 31' in text
        assert 'pyllama_requests_total{route="/v1/models/{model}",status="200"} 1' in text
        assert "probe-" not in text
        assert 'pyllama_kv_blocks_free{model="we\\"ird\\\\name"}' in text
        for line in text.splitlines():
            if line and not line.startswith("#"):
                match = _SAMPLE.match(line)
                assert match, line
                float(match.group(2))
    finally:
        s.close()
        reg.close()
