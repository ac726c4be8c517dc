"""Server administration and configuration: model unload/load with the admin key, /health while loading,
a model without a chat template, config files and the ``trellm serve`` command line."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
try:
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from trellm.errors import ConfigError  # noqa: E402
from trellm.server.cli import config_from_args, with_keys  # noqa: E402
from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY, ADMIN_KEY = "admin-test-api-0123456", "admin-test-admin-0123456"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def no_template_dir(tiny_llama_smollm2_tokenizer_dir, tmp_path_factory):
    """The tiny Llama with every chat template removed."""
    out = tmp_path_factory.mktemp("no_template")
    for f in tiny_llama_smollm2_tokenizer_dir.iterdir():
        if f.name != "chat_template.jinja":
            shutil.copy(f, out / f.name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def link_or_copy(src_dir, dst_dir) -> None:
    """A model directory's files under ``dst_dir`` (hard links where the filesystem allows: no symlink leaves it)."""
    import os

    dst_dir.mkdir(parents=True)
    for f in src_dir.iterdir():
        try:
            os.link(f, dst_dir / f.name)
        except OSError:
            shutil.copy(f, dst_dir / f.name)


@pytest.fixture(scope="module")
def models_root(smollm2_dir, tmp_path_factory):
    """The server's --models-dir: SmolLM2 as "smol"; tests add models to it."""
    root = tmp_path_factory.mktemp("models")
    link_or_copy(smollm2_dir, root / "smol")
    return root


@pytest.fixture(scope="module")
def server(no_template_dir, models_root):
    config = ServerConfig(model=str(no_template_dir), model_name="tiny", api_key=API_KEY, admin_key=ADMIN_KEY, device="cpu",
                          cache_size=512, page_size=32, max_tokens_limit=8, allow_request_chat_template=True,
                          models_dir=str(models_root))
    with ServerThread(config) as s:
        yield s


def test_missing_chat_template_is_a_clear_400(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert e.value.code == "chat_template_missing" and "chat_template" in e.value.message
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body={"chat_template": template})
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_unload_then_load_with_health_503_while_loading(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert httpx.post(server.url + "/v1/model/unload", headers=ADMIN).json() == {"status": "unloaded"}
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "empty"
    with pytest.raises(openai.InternalServerError) as e:  # 503: no model
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "model_not_ready"
    assert client.models.list().data == []

    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(httpx.get(server.url + "/health").status_code)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = httpx.post(server.url + "/v1/model/load", headers=ADMIN, timeout=300,
                       json={"model": "smol", "model_name": "smol", "cache_size": 1024})
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200 and r.json()["id"] == "smol"
    assert 503 in seen and httpx.get(server.url + "/health").status_code == 200
    assert client.completions.create(model="smol", prompt="The capital of France is", max_tokens=2,
                                     temperature=0).choices[0].text.startswith(" Paris")
    bad = httpx.post(server.url + "/v1/model/load", headers=ADMIN, json={"model": "no-such-model"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/health").status_code == 200  # a bad load request leaves the model alone


def test_hybrid_model_batches_like_it_runs_alone(server, tiny_llama_smollm2_tokenizer_dir, models_root):
    """A model with recurrent layers (Qwen3.5 layout) loaded by the admin route: its cache gets state slots."""
    import asyncio

    from trellm.sdk.testing import make_tiny_hf_model

    linear = {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "num_hidden_layers": 3,
              "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
    vocab = json.loads((tiny_llama_smollm2_tokenizer_dir / "config.json").read_text())["vocab_size"]
    out = make_tiny_hf_model("Qwen3_5ForCausalLM", models_root / "hybrid", vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                             pad_token_id=2, **linear)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_smollm2_tokenizer_dir / name, out / name)
    r = httpx.post(server.url + "/v1/model/load", headers=ADMIN, timeout=300, json={"model": "hybrid", "model_name": "hybrid"})
    assert r.status_code == 200, r.text
    assert server.host.generator.state_layers
    prompts = ("Hello", "The sky is", "one two three")

    async def run() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            async def one(p: str) -> str:
                r = await client.completions.create(model="hybrid", prompt=p, max_tokens=6, temperature=0)
                return r.choices[0].text
            return [await one(p) for p in prompts], list(await asyncio.gather(*(one(p) for p in prompts)))

    alone, together = asyncio.run(run())
    assert together == alone and all(alone)


def test_config_file_and_flags(tmp_path):
    from trellm.cli import build_parser

    (tmp_path / "serve.yaml").write_text("port: 6001\nmax-queue: 3\ncache_bits: 4,6\napi_key: from-file-0123456789\n")
    args = build_parser().parse_args(["serve", "--config", str(tmp_path / "serve.yaml"), "--max-queue", "9", "-m", "/models/x"])
    config = config_from_args(args)
    got = (config.port, config.max_queue, config.cache_bits, config.api_key, config.model)
    assert got == (6001, 9, (4, 6), "from-file-0123456789", "/models/x")
    config, notes = with_keys(config)
    assert config.api_key == "from-file-0123456789" and len(config.admin_key) == 32 and len(notes) == 1
    (tmp_path / "serve.json").write_text(json.dumps({"disable_auth": True, "port": 7000}))
    config, notes = with_keys(config_from_args(build_parser().parse_args(["serve", "--config", str(tmp_path / "serve.json")])))
    assert config.disable_auth and config.api_key is None and "DISABLED" in notes[0]
    (tmp_path / "bad.yaml").write_text("prot: 1\n")
    with pytest.raises(ConfigError, match="prot"):
        config_from_args(build_parser().parse_args(["serve", "--config", str(tmp_path / "bad.yaml")]))
    with pytest.raises(ConfigError, match="cache_bits"):
        ServerConfig(cache_bits="4,9")


def test_swap_reports_loading_while_capturing_and_a_failed_capture_fails_the_load(tiny_llama_smollm2_tokenizer_dir, monkeypatch):
    """The graphs are captured after the old model is unloaded: requests meanwhile hear "still loading" (not "no
    model is loaded"), and a capture that raises leaves the state "failed" with its error, the new model closed."""
    import asyncio

    from trellm.generator import Generator
    from trellm.server.engine import STATE_FAILED, STATE_LOADING, LoadSettings, ModelHost, ModelNotReadyError

    config = ServerConfig(model=str(tiny_llama_smollm2_tokenizer_dir), model_name="tiny", device="cpu", cache_size=256,
                          page_size=32)
    host = ModelHost(config)
    settings = LoadSettings.from_config(config, tiny_llama_smollm2_tokenizer_dir)
    asyncio.run(host.load(settings))
    assert host.ready
    during = []

    def capture(generator):
        with pytest.raises(ModelNotReadyError, match="still loading"):
            host.require_ready()
        during.append(host.state)
        return []

    monkeypatch.setattr(Generator, "capture_graphs", capture)
    asyncio.run(host.load(settings))  # a second load swaps the model
    assert during == [STATE_LOADING] and host.ready

    closed = []

    def fail(generator):
        raise RuntimeError("capture went wrong")

    real_build = __import__("trellm.server.engine", fromlist=["_build"])._build

    def build(settings):
        lm, generator = real_build(settings)
        close = lm.close
        lm.close = lambda: (closed.append(lm), close())
        return lm, generator

    monkeypatch.setattr(Generator, "capture_graphs", fail)
    monkeypatch.setattr("trellm.server.engine._build", build)
    with pytest.raises(RuntimeError, match="capture went wrong"):
        asyncio.run(host.load(settings))
    assert host.state == STATE_FAILED and "capture went wrong" in host.error and len(closed) == 1
    with pytest.raises(ModelNotReadyError, match="failed to load: RuntimeError: capture went wrong"):
        host.require_ready()
