"""The OpenAI-compatible server, started for real on 127.0.0.1 with SmolLM2 on CPU and driven by the
official ``openai`` client: completions, chat, streaming, usage, stop strings, n > 1, logprobs, the
errors the client raises, concurrency, client disconnects, the queue limit and auth."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package uses (httpx2 in newer releases)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY, ADMIN_KEY = "test-api-key-0123456", "test-admin-key-0123456"
MAX_BATCH = 8
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServerConfig(model=str(smollm2_dir), api_key=API_KEY, admin_key=ADMIN_KEY, device="cpu", cache_size=4096,
                          page_size=64, max_batch_size=MAX_BATCH, max_queue=0, max_request_bytes=64 * 1024,
                          allow_request_chat_template=True, max_tokens_limit=None)
    with ServerThread(config) as s:
        s.model = s.host.model_name
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def wait_idle(server, timeout: float = 20.0) -> float:
    """Seconds until the generator has no jobs left (fails after ``timeout``)."""
    gen, t0 = server.host.generator, time.time()
    while gen.has_work() or server.host.in_flight:
        assert time.time() - t0 < timeout, f"generator still busy: {gen.num_active} active, {gen.num_pending} pending"
        time.sleep(0.02)
    return time.time() - t0


def assert_pages_free(server) -> None:
    """Every cache page is free or held only by the prefix cache (reusable), and refcounts add up."""
    gen = server.host.generator
    gen.verify_pages()
    assert gen.cache.prefix_cache.available() == gen.cache.num_pages


# ---- basics ------------------------------------------------------------------------------------------


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_greedy_usage_and_logprobs(server, client):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(" Paris") and choice.finish_reason == "length"
    prompt_ids = httpx.post(server.url + "/v1/token/encode", json={"text": PROMPT}, headers={"x-api-key": API_KEY}).json()
    assert r.usage.prompt_tokens == prompt_ids["length"] and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 5 and len(lp.top_logprobs) == 5
    assert all(max(top.values()) == pytest.approx(v, abs=1e-5) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_stream_matches_whole_and_reports_usage(server, client):
    whole = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert len(whole.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    assert bytes(b for t in whole.choices[0].logprobs.content for b in t.bytes).decode("utf-8") == text
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings(server, client):
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = full[3:6]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_n_choices_and_seed(server, client):
    greedy = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1 and greedy.usage.completion_tokens == 12
    kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=2, seed=7,
                  extra_body={"top_k": 40})
    a = [c.text for c in client.completions.create(**kwargs).choices]
    b = [c.text for c in client.completions.create(**kwargs).choices]
    assert a == b  # seeded sampling repeats (choice j uses seed + j)
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=3, temperature=0, n=2,
                                                 stream=True))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts[0] == texts[1] != ""


def test_trellm_sampler_fields_and_logit_bias(server, client):
    paris = httpx.post(server.url + "/v1/token/encode", json={"text": " Paris", "add_special_tokens": False},
                       headers={"x-api-key": API_KEY}).json()["tokens"]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(paris[0]): -100})
    assert not r.choices[0].text.startswith(" Paris")
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0.8, seed=1, presence_penalty=0.5,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "dry_multiplier": 0.8,
                                              "dry_sequence_breakers": ["\n", ":"], "xtc_probability": 0.5, "typical_p": 0.95})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_token_encode_decode(server):
    h = {"Authorization": f"Bearer {API_KEY}"}
    enc = httpx.post(server.url + "/v1/token/encode", json={"text": "hello world"}, headers=h).json()
    dec = httpx.post(server.url + "/v1/token/decode", json={"tokens": enc["tokens"]}, headers=h).json()
    assert dec["text"].endswith("hello world") and enc["length"] == len(enc["tokens"])
    chat = httpx.post(server.url + "/v1/token/encode", json={"text": CHAT}, headers=h).json()
    assert chat["length"] > enc["length"]
    bad = httpx.post(server.url + "/v1/token/decode", json={"tokens": [10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- errors as the client raises them --------------------------------------------------------------


def test_errors_have_openai_shape(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=100_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, logit_bias={"not-an-id": 1})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2, top_logprobs=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # a template that raises is the request's fault, not a 500
        client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": "{{ raise_exception('no users here') }}"})
    assert "no users here" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(server.url + "/v1/nothing-here", headers={"x-api-key": API_KEY})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (65 * 1024), headers={"x-api-key": API_KEY})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_auth(server):
    url = server.url + "/v1/models"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200  # admin opens everything
    r = httpx.post(server.url + "/v1/model/unload", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert httpx.post(server.url + "/v1/model/unload").status_code == 401
    info = httpx.get(server.url + "/v1/model", headers={"x-api-key": ADMIN_KEY}).json()
    assert info["state"] == "ready" and info["id"] == server.model
    assert server.host.ready


# ---- concurrency, disconnects, the queue --------------------------------------------------------------


def test_concurrent_streams_match_sequential(server):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
    async def run() -> tuple[list[str], list[str], int]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as aclient:
            async def one(prompt: str) -> str:
                stream = await aclient.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                                          stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])

            alone = [await one(p) for p in prompts]
            steps_before = server.host.generator.stats["steps"]
            together = list(await asyncio.gather(*(one(p) for p in prompts)))
            return alone, together, server.host.generator.stats["steps"] - steps_before

    alone, together, steps = asyncio.run(run())
    assert together == alone
    assert steps < 4 * 7  # the streams were batched together, not run one after another
    wait_idle(server)
    assert_pages_free(server)


def test_client_disconnect_frees_job_and_pages(server):
    gen = server.host.generator
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True, "n": 2}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers={"x-api-key": API_KEY}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    got += 1
                if got >= 2:
                    break
            assert gen.num_active == 2
            decoded_at_close = gen.stats["decoded_tokens"]
    seconds = wait_idle(server)
    assert seconds < 5 and gen.stats["decoded_tokens"] - decoded_at_close < 2 * 20
    assert_pages_free(server)


def test_non_streaming_client_that_gives_up_frees_its_job(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers={"x-api-key": API_KEY}, timeout=1.5)
    assert wait_idle(server) < 5
    assert_pages_free(server)


def test_full_queue_answers_429_with_retry_after(server, client):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True, "n": MAX_BATCH}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers={"x-api-key": API_KEY}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)
            assert server.host.in_flight == MAX_BATCH
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
            assert e.value.response.headers["retry-after"] == "1" and e.value.code == "queue_full"
    wait_idle(server)
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    assert_pages_free(server)


def test_image_parts_for_a_text_model_are_400(server, client):
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert e.value.body["param"] == "messages" and "takes no image input" in e.value.message
    assert client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2).choices[0].message.content
