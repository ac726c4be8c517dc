"""The server under schemathesis: requests generated from its own OpenAPI schema never get a 5xx and
never take it down. Runs against a tiny random Llama (SmolLM2's tokenizer) on 127.0.0.1 to stay fast.
The API routes (embeddings and metrics included) run with the API key; model loads with the admin key
against a --models-dir (unload is left out: it would leave nothing to fuzz)."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY, ADMIN_KEY = "fuzz-key-0123456789", "fuzz-admin-0123456789"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_ROUTES = ("/v1/model", "/v1/model/load")


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_smollm2_tokenizer_dir, tmp_path_factory):
    models = tmp_path_factory.mktemp("fuzz_models")
    (models / "empty").mkdir()  # a name that exists but holds no model
    config = ServerConfig(model=str(tiny_llama_smollm2_tokenizer_dir), api_key=API_KEY, admin_key=ADMIN_KEY, device="cpu",
                          models_dir=str(models), max_failed_auth=10**6,
                          cache_size=1024, page_size=32, max_batch_size=8, max_queue=32, max_n=4, max_tokens_limit=8,
                          default_max_tokens=8, strict_model_name=False, max_request_bytes=256 * 1024)
    with ServerThread(config) as server:
        yield server


def schema_of(server, keep) -> object:
    import json
    import urllib.request

    with urllib.request.urlopen(server.url + "/openapi.json") as r:
        raw = json.load(r)
    raw["paths"] = {p: v for p, v in raw["paths"].items() if keep(p)}
    return schemathesis.openapi.from_dict(raw)


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schema_of(fuzz_server, lambda p: not p.startswith("/v1/model/") and p != "/v1/model")


@pytest.fixture(scope="module")
def admin_schema(fuzz_server):
    return schema_of(fuzz_server, lambda p: p in ADMIN_ROUTES)


schema = schemathesis.pytest.from_fixture("fuzz_schema")
admin = schemathesis.pytest.from_fixture("admin_schema")


def check_response(case, response) -> None:
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, fuzz_server):
    check_response(case, case.call(base_url=fuzz_server.url, headers=HEADERS, timeout=60))


@admin.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_admin_routes_no_server_errors(case, fuzz_server):
    check_response(case, case.call(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60))


def test_still_serving_after_fuzzing(fuzz_server):
    import urllib.request

    with urllib.request.urlopen(fuzz_server.url + "/health") as r:
        assert r.status == 200
    gen = fuzz_server.host.generator
    assert gen.stats["decoded_tokens"] > 0  # fuzzed requests got as far as generating
    gen.verify_pages()
