"""The server is safe to expose: one test per finding of the loopback audit (issue 28), each against a real
server on 127.0.0.1 serving a tiny random Llama with SmolLM2's tokenizer, driven by the openai client or
raw sockets: request chat templates, work kept off the event loop, request limits, connection timeouts
and cap, context length, max_tokens, auth limits, admin loads, /health, SIGTERM."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
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
from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread, free_port  # noqa: E402

API_KEY, ADMIN_KEY = "hardening-api-key-0123", "hardening-admin-key-0123"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
API = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]
MODEL_CONTEXT = 1024  # max_position_embeddings of tiny_llama_smollm2_tokenizer_dir


def tiny_config(model_dir, **overrides) -> ServerConfig:
    settings = dict(model=str(model_dir), model_name="tiny", api_key=API_KEY, admin_key=ADMIN_KEY, device="cpu",
                    cache_size=2048, page_size=32, max_batch_size=4, max_tokens_limit=64)
    settings.update(overrides)
    return ServerConfig(**settings)


@pytest.fixture(scope="module")
def models_dir(tiny_llama_smollm2_tokenizer_dir, tmp_path_factory):
    """A --models-dir holding the tiny model (a symlink) and an escape attempt (a symlink to a directory outside)."""
    root = tmp_path_factory.mktemp("models")
    outside = tmp_path_factory.mktemp("outside")
    for f in tiny_llama_smollm2_tokenizer_dir.iterdir():
        (outside / f.name).symlink_to(f)
    (root / "escape").symlink_to(outside)
    real = root / "real"
    real.mkdir()
    for f in tiny_llama_smollm2_tokenizer_dir.iterdir():
        (real / f.name).write_bytes(f.read_bytes())
    return root


@pytest.fixture(scope="module")
def server(models_dir):
    config = tiny_config(models_dir / "real", models_dir=str(models_dir), max_images=2, max_image_pixels=4096,
                         max_prompt_bytes=20_000, max_failed_auth=5)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


# ---- request chat templates -----------------------------------------------------------------------------

SLOW_TEMPLATE = "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}x{% endfor %}{% endfor %}{% endfor %}"


def test_request_chat_template_is_refused_by_default(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body={"chat_template": "{{ 'x' }}"})
    assert e.value.code == "chat_template_not_allowed" and "--allow-request-chat-template" in e.value.message


def test_request_chat_template_runs_sandboxed_with_limits(tiny_llama_smollm2_tokenizer_dir):
    """Allowed: a template that would run for hours is stopped at the time limit, one that fills memory at the
    memory limit, while /health keeps answering; distinct templates do not grow the server's memory."""
    config = tiny_config(tiny_llama_smollm2_tokenizer_dir, allow_request_chat_template=True, template_timeout_s=3.0)
    with ServerThread(config) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        health_times: list[float] = []
        stop = threading.Event()

        def probe():
            while not stop.is_set():
                t0 = time.time()
                httpx.get(s.url + "/health", timeout=30)
                health_times.append(time.time() - t0)
                time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body={"chat_template": SLOW_TEMPLATE})
            assert e.value.code == "chat_template_limit" and "3 s" in e.value.message
            hog = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body={"chat_template": hog})
            assert e.value.code == "chat_template_limit"
        finally:
            stop.set()
            prober.join()
        # a loop blocked by the template would hold /health for the whole 3 s limit; a busy machine adds far less
        assert health_times and max(health_times) < 2.0
        ok = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        for i in range(5):
            r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                          extra_body={"chat_template": ok + "{# %d #}" % i})
            assert r.usage.prompt_tokens > 0
        from trellm.tokenizer import _TEMPLATE_CACHE

        assert not any("{# " in t for t in _TEMPLATE_CACHE)  # request templates never reach the server's own cache


# ---- CPU work off the event loop, request limits --------------------------------------------------------


def test_templating_and_tokenization_run_off_the_event_loop(server, client):
    """The server thread runs the event loop; the tokenizer and the model's template must never run on it."""
    tok = server.host.tokenizer
    seen: list[str] = []
    encode, apply = tok.encode, tok.apply_chat_template

    def recording(fn):
        def wrapper(*a, **k):
            seen.append(threading.current_thread().name)
            return fn(*a, **k)
        return wrapper

    tok.encode, tok.apply_chat_template = recording(encode), recording(apply)
    try:
        client.completions.create(model="tiny", prompt="hello there", max_tokens=1)
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    finally:
        del tok.encode, tok.apply_chat_template
    assert seen and "trellm-server" not in seen


def test_prompt_bytes_images_and_pixels_are_limited(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x" * 20_001, max_tokens=1)
    assert e.value.code == "prompt_too_large" and "20000" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "y" * 20_001}])
    assert e.value.code == "prompt_too_large"

    from PIL import Image

    def part(w: int, h: int) -> dict:
        buf = io.BytesIO()
        Image.new("RGB", (w, h)).save(buf, format="PNG")
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [part(4, 4)] * 3}])
    assert e.value.code == "too_many_images" and "2" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # 2 * 48 * 48 pixels > 4096
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": [part(48, 48)] * 2}])
    assert e.value.code == "too_many_pixels" and "4096" in e.value.message


# ---- connections ------------------------------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def test_idle_and_half_sent_connections_are_closed_and_capped(tiny_llama_smollm2_tokenizer_dir):
    config = tiny_config(tiny_llama_smollm2_tokenizer_dir, request_timeout_s=0.5, max_connections=6)
    with ServerThread(config) as s:
        port = s.config.port
        idle = socket.create_connection(("127.0.0.1", port))
        half_headers = socket.create_connection(("127.0.0.1", port))
        half_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        half_body = socket.create_connection(("127.0.0.1", port))
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\"")
        for sock in (idle, half_headers, half_body):
            assert _closed_within(sock, 5.0)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        extra = socket.create_connection(("127.0.0.1", port))
        assert _closed_within(extra, 2.0)  # beyond the cap: closed at once
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(s.url + "/health").status_code == 200  # served again once the slots are free


# ---- lengths and max_tokens ---------------------------------------------------------------------------------


def test_prompt_beyond_model_context_is_400_naming_both_numbers(client):
    prompt = list(range(10, 10 + 1000))  # 1000 token ids; the cache (2048) would hold it, the model (1024) cannot
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=50)
    assert e.value.code == "context_length_exceeded"
    assert str(MODEL_CONTEXT) in e.value.message and "1000" in e.value.message and "50" in e.value.message
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24)
    assert r.usage.prompt_tokens == 1000


def test_max_tokens_has_a_default_and_a_maximum(client):
    assert ServerConfig().max_tokens_limit is not None and ServerConfig().default_max_tokens <= ServerConfig().max_tokens_limit
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=65)
    assert "64" in e.value.message and e.value.param == "max_tokens"
    r = client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 64  # no max_tokens: the default, capped by the limit


def test_one_request_cannot_hold_the_cache(tiny_llama_smollm2_tokenizer_dir):
    """A long job asks for most of a small cache; short requests arriving later still finish while it runs."""
    config = tiny_config(tiny_llama_smollm2_tokenizer_dir, cache_size=512, page_size=16, max_tokens_limit=None)
    with ServerThread(config) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        long_stream = c.completions.create(model="tiny", prompt="a long story", max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(long_stream))  # running now
        assert first.choices
        t0 = time.time()
        shorts = [c.completions.create(model="tiny", prompt=f"short {i}", max_tokens=4, extra_body={"ignore_eos": True})
                  for i in range(3)]
        short_done = time.time()
        assert all(r.usage.completion_tokens == 4 for r in shorts)
        rest = list(long_stream)
        long_done = time.time()
        assert sum(len(ch.choices[0].text) > 0 for ch in rest if ch.choices) > 100
        assert short_done < long_done and short_done - t0 < long_done - t0
        s.host.generator.verify_pages()


def test_default_configuration_uses_every_batch_slot(tiny_llama_smollm2_tokenizer_dir):
    from trellm.generator import Job
    from trellm.server.engine import LoadSettings, _build

    config = ServerConfig(device="cpu")
    _, gen = _build(LoadSettings.from_config(config, tiny_llama_smollm2_tokenizer_dir))
    prompt = list(range(100, 140))  # a short chat turn
    jobs = [Job(prompt, config.default_max_tokens, identifier=i) for i in range(config.max_batch_size)]
    gen.enqueue(jobs)
    gen.iterate()
    assert gen.num_active == config.max_batch_size


# ---- auth ---------------------------------------------------------------------------------------------------


def test_short_api_keys_are_refused():
    from trellm.server.cli import with_keys

    with pytest.raises(ConfigError, match="16"):
        with_keys(ServerConfig(api_key="short", admin_key="x" * 32))
    with pytest.raises(ConfigError, match="admin_key"):
        with_keys(ServerConfig(api_key="x" * 32, admin_key="0123456789"))


def test_failed_authentications_are_limited(server):
    codes = [httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer wrong-key-{i:020d}"}).status_code
             for i in range(7)]
    assert codes[:5] == [401] * 5 and codes[5:] == [429, 429]
    blocked = httpx.get(server.url + "/v1/models", headers=API)
    assert blocked.status_code == 429 and int(blocked.headers["Retry-After"]) >= 1
    server.app.state.auth_failures.clear()  # the window passes (the limiter's state is the server's)
    assert httpx.get(server.url + "/v1/models", headers=API).status_code == 200


def test_failed_authentications_behind_a_trusted_proxy_count_per_forwarded_client(server):
    """The test client is on 127.0.0.1, the default trusted proxy: X-Forwarded-For names the client, so one
    client's failures block it alone, not every client behind the proxy."""
    def get(client: str, key: str) -> int:
        return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": client}).status_code

    try:
        codes = [get("203.0.113.7", f"wrong-key-{i:020d}") for i in range(6)]
        assert codes == [401] * 5 + [429]
        assert get("203.0.113.7", API_KEY) == 429
        assert get("198.51.100.9", API_KEY) == 200 and get("198.51.100.9", "wrong-key-" + "0" * 20) == 401
        assert httpx.get(server.url + "/v1/models", headers=API).status_code == 200  # the proxy's own address
        assert set(server.app.state.auth_failures) == {"203.0.113.7", "198.51.100.9"}
    finally:
        server.app.state.auth_failures.clear()


def test_forwarded_for_is_ignored_from_an_untrusted_address(tiny_llama_smollm2_tokenizer_dir):
    """With no trusted proxy a client cannot escape its limit by naming another address."""
    with ServerThread(tiny_config(tiny_llama_smollm2_tokenizer_dir, trusted_proxies="", max_failed_auth=2)) as s:
        codes = [httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer wrong-key-{i:020d}",
                                                          "X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(3)]
        assert codes == [401, 401, 429] and list(s.app.state.auth_failures) == ["127.0.0.1"]


# ---- admin and health ---------------------------------------------------------------------------------------


def test_admin_load_takes_names_under_models_dir_only(server, models_dir, tiny_llama_smollm2_tokenizer_dir):
    def load(name: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/model/load", headers=ADMIN, json={"model": name}, timeout=120)

    for name in (str(tiny_llama_smollm2_tokenizer_dir), "../" + models_dir.name + "/real", "escape", "/etc", "nope"):
        r = load(name)
        assert r.status_code in (400, 404), (name, r.text)
        error = r.json()["error"]
        assert error["code"] in ("model_not_found", "invalid_model_name") and str(tiny_llama_smollm2_tokenizer_dir) not in error["message"]
    assert load("a" * 300).status_code == 400  # a name longer than a file name: refused, not a 500
    assert load("x/" * 2000).status_code == 400
    assert server.host.model_name == "tiny"  # every refused load kept the model
    r = load("real")
    assert r.status_code == 200 and r.json()["id"] == "real"


def test_failed_load_keeps_the_old_model_and_health_shows_no_paths(server, models_dir):
    broken = models_dir / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nope"}))
    before = server.host.model_name
    r = httpx.post(server.url + "/v1/model/load", headers=ADMIN, json={"model": "broken"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"
    assert str(models_dir) not in r.json()["error"]["message"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["model"] == before
    assert "/" not in json.dumps(health.json())
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert c.completions.create(model=before, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_model_card_has_max_model_len(client):
    card = client.models.retrieve(client.models.list().data[0].id)
    assert card.model_extra["max_model_len"] == MODEL_CONTEXT


# ---- SIGTERM ------------------------------------------------------------------------------------------------


def test_sigterm_drains_then_ends_streams_with_an_error_and_done(tiny_llama_smollm2_tokenizer_dir, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "trellm.cli", "serve", "-m", str(tiny_llama_smollm2_tokenizer_dir), "--model-name", "tiny",
           "--port", str(port), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--device", "cpu", "--cache-size", "4096",
           "--page-size", "32", "--max-tokens-limit", "100000", "--shutdown-grace", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "go", "max_tokens": 1000, "ignore_eos": True}
        lines: list[str] = []
        whole: dict = {}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", headers=API, json={**body, "stream": True}, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def plain():
            r = httpx.post(url + "/v1/completions", headers=API, json=body, timeout=60)
            whole.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        # SIGTERM once both requests run: the stream has tokens (a fixed sleep lost that race on a loaded machine)
        started = time.time()
        while len(lines) <= 3 and time.time() - started < 60 and all(t.is_alive() for t in threads):
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
    assert len(lines) > 3  # tokens streamed before the grace period ran out
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "server_shutting_down"


def test_preempted_jobs_are_recomputed_to_the_same_tokens(tiny_llama_smollm2_tokenizer_dir):
    """Jobs that together outgrow the cache: the latest are preempted and recomputed, and every job's tokens
    equal the tokens it gets alone (greedy), with no page leaked."""
    import trellm
    from trellm.generator import Generator, Job, JobFinished, TokenChunk

    lm = trellm.load(tiny_llama_smollm2_tokenizer_dir, device="cpu")
    prompts = [[100 + 7 * i + k for k in range(5 + 3 * i)] for i in range(3)]

    def run(gen: Generator, jobs: list[Job]) -> dict[int, list[int]]:
        gen.enqueue(jobs)
        streamed = {j.identifier: [] for j in jobs}
        finished = {}
        while gen.has_work():
            for r in gen.iterate():
                if isinstance(r, TokenChunk):
                    streamed[r.identifier] += r.token_ids
                elif isinstance(r, JobFinished):
                    finished[r.identifier] = r.token_ids
            gen.verify_pages()
        assert streamed == finished
        return finished

    together = Generator(lm, cache_tokens=8 * 10, page_size=8, max_batch_size=3)
    got = run(together, [Job(p, 40, stop_token_ids=[], identifier=i) for i, p in enumerate(prompts)])
    assert together.stats["preempted"] > 0
    for i, p in enumerate(prompts):
        alone = Generator(lm, cache_tokens=8 * 10, page_size=8, max_batch_size=1)
        assert got[i] == run(alone, [Job(p, 40, stop_token_ids=[], identifier=i)])[i], f"job {i}"
    together.clear_prefix_cache()
    assert together.cache.allocator.free_pages == together.cache.num_pages
