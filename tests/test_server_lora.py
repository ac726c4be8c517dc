"""LoRA adapters in the server: ``--lora NAME=DIR`` served as ``<model>:NAME`` (vLLM's naming), chosen by the
request's ``model`` with the real openai client, listed by /v1/models, loaded and unloaded by the admin."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
try:
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

import trellm  # noqa: E402
from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY, ADMIN_KEY = "lora-test-api-key-0001", "lora-test-admin-key-0001"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [1, 504, 2306, 314, 253, 6553, 28, 1837, 314]  # token ids: no tokenizer subtleties between the two paths


@pytest.fixture(scope="module")
def adapters(tiny_llama_smollm2_tokenizer_dir, tmp_path_factory):
    from test_lora import make_peft_adapter

    root = tmp_path_factory.mktemp("server_lora")
    base = tiny_llama_smollm2_tokenizer_dir
    sql = make_peft_adapter(base, root / "sql", r=8, alpha=16, targets=["q_proj", "v_proj", "o_proj", "down_proj"], std=0.3)
    other = make_peft_adapter(base, root / "other", r=4, alpha=4, targets=["up_proj"], seed=5, std=0.3)
    return sql, other


@pytest.fixture(scope="module")
def server(tiny_llama_smollm2_tokenizer_dir, adapters):
    config = ServerConfig(model=str(tiny_llama_smollm2_tokenizer_dir), model_name="tiny", api_key=API_KEY,
                          admin_key=ADMIN_KEY, device="cpu", cache_size=1024, page_size=32, lora=[f"sql={adapters[0]}"],
                          models_dir=str(adapters[1].parent))
    with ServerThread(config) as s:
        yield s


def test_base_and_adapter_answer_differently_and_each_equals_the_python_api(server, tiny_llama_smollm2_tokenizer_dir, adapters):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    ids = {m.id: m for m in client.models.list().data}
    assert set(ids) == {"tiny", "tiny:sql"}
    assert ids["tiny:sql"].model_extra.get("parent") == "tiny"

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.model == model
        return r.choices[0].text

    base_text, sql_text = complete("tiny"), complete("tiny:sql")
    assert base_text != sql_text
    lm = trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cpu")
    lm.load_lora(adapters[0], name="sql")
    assert sql_text == lm.generate(PROMPT, max_new_tokens=12, lora="sql")
    assert base_text == lm.generate(PROMPT, max_new_tokens=12)
    chat = client.chat.completions.create(model="tiny:sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "tiny:sql" and chat.usage.completion_tokens >= 1


def test_unknown_adapter_is_404(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'nope'"):
        client.completions.create(model="tiny:nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny:nope")


def test_admin_loads_and_unloads_adapters(server, adapters):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    r = httpx.post(server.url + "/v1/lora/load", json={"name": "other", "path": adapters[1].name}, headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "tiny:other"
    assert {m.id for m in client.models.list().data} == {"tiny", "tiny:sql", "tiny:other"}
    assert client.models.retrieve("tiny:other").id == "tiny:other"
    text = client.completions.create(model="tiny:other", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    assert text != client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    outside = httpx.post(server.url + "/v1/lora/load", json={"name": "x", "path": "/etc"}, headers=ADMIN, timeout=60)
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "invalid_model_name"  # only under --models-dir
    missing = httpx.post(server.url + "/v1/lora/load", json={"name": "x", "path": "nope"}, headers=ADMIN, timeout=60)
    assert missing.status_code == 404
    key_needed = httpx.post(server.url + "/v1/lora/unload", json={"name": "other"},
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert key_needed.status_code in (401, 403)
    assert httpx.post(server.url + "/v1/lora/unload", json={"name": "other"}, headers=ADMIN, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny:other", prompt=PROMPT, max_tokens=2)
    assert httpx.post(server.url + "/v1/lora/unload", json={"name": "other"}, headers=ADMIN, timeout=60).status_code == 404


def test_cli_generate_with_lora(tiny_llama_smollm2_tokenizer_dir, adapters, capsys):
    from trellm.cli import main

    model = str(tiny_llama_smollm2_tokenizer_dir)
    assert main(["generate", "-m", model, "--device", "cpu", "--lora", str(adapters[0]), "--max-tokens", "8", "Hello"]) == 0
    with_adapter = capsys.readouterr().out
    lm = trellm.load(model, device="cpu", lora=adapters[0])
    assert with_adapter == lm.generate("Hello", max_new_tokens=8) + "\n"
    assert with_adapter != lm.generate("Hello", max_new_tokens=8, lora="") + "\n"
