"""/v1/embeddings against HF transformers on the same tiny Llama, and /metrics read back with
prometheus-client's parser, through a real server on 127.0.0.1 and the official openai client."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
try:
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from trellm.server.config import ServerConfig  # noqa: E402
from trellm.server.testing import ServerThread  # noqa: E402

API_KEY = "observability-key-0123"
TEXTS = ["The capital of France is Paris.", "hello", "A somewhat longer sentence about the weather in spring."]


@pytest.fixture(scope="module")
def served(tiny_llama_smollm2_tokenizer_dir):
    config = ServerConfig(model=str(tiny_llama_smollm2_tokenizer_dir), model_name="tiny", api_key=API_KEY,
                          admin_key="observability-admin-0123", device="cpu", dtype="float32", cache_size=1024,
                          page_size=32, max_batch_size=4)
    with ServerThread(config) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def hf_last_token_embeddings(model_dir, texts: list[str]):
    """Reference: HF's last_hidden_state at the last token, L2-normalised."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            h = model(input_ids=ids).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=0))
    return out


def test_embeddings_match_hf_last_token_pooling(served, tiny_llama_smollm2_tokenizer_dir):
    import torch

    server, client = served
    r = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > len(TEXTS)
    reference = hf_last_token_embeddings(tiny_llama_smollm2_tokenizer_dir, TEXTS)
    for d, ref in zip(r.data, reference):
        got = torch.tensor(d.embedding)
        assert got.shape == ref.shape and torch.linalg.norm(got).item() == pytest.approx(1.0, abs=1e-4)
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-3)
    floats = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float", dimensions=8)
    short = torch.tensor(floats.data[0].embedding)
    assert short.shape == (8,)
    torch.testing.assert_close(short, torch.nn.functional.normalize(reference[1][:8], dim=0), atol=2e-4, rtol=1e-3)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input=list(range(5, 1100)))
    assert e.value.code == "context_length_exceeded" and "1024" in e.value.message
    server.host.generator.verify_pages()


def test_metrics_in_prometheus_format(served):
    from prometheus_client.parser import text_string_to_metric_families

    server, client = served
    client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        stream=True, extra_body={"ignore_eos": True}))
    httpx.get(server.url + "/no/such/route/" + "x" * 50, headers={"x-api-key": API_KEY})
    assert httpx.get(server.url + "/metrics").status_code == 401
    r = httpx.get(server.url + "/metrics", headers={"x-api-key": API_KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("trellm_requests_total", (("route", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("trellm_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] >= 1
    assert samples[("trellm_requests_total", (("route", "other"), ("status", "404")))] >= 1
    assert samples[("trellm_generation_tokens_total", ())] >= 9
    assert samples[("trellm_prompt_tokens_total", ())] > 0
    assert samples[("trellm_time_to_first_token_seconds_count", ())] >= 2
    assert samples[("trellm_time_per_output_token_seconds_count", ())] >= 2
    for gauge in ("trellm_jobs_running", "trellm_jobs_waiting", "trellm_kv_cache_usage_ratio", "trellm_preemptions"):
        assert (gauge, ()) in samples
    assert 0.0 <= samples[("trellm_kv_cache_usage_ratio", ())] <= 1.0
