"""`-m org/name` and `trellm download` against a Hub-like HTTP server on loopback (HF_ENDPOINT), never the internet.

The server answers the Hub API calls huggingface_hub makes (repo info, file tree, resolve with HEAD and
GET) for one tiny model, and records every path asked for.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serves the files of ``model_dir`` as the main branch of ``REPO``."""

    def __init__(self, model_dir: Path):
        self.files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _send(self, h: BaseHTTPRequestHandler, status: int, data: bytes, body: bool, headers: dict | None = None):
        h.send_response(status)
        for key, value in {"Content-Length": str(len(data)), "X-Repo-Commit": COMMIT, **(headers or {})}.items():
            h.send_header(key, value)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append(f"{h.command} {path}")
        api = f"/api/models/{REPO}"
        if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
            info = {"id": REPO, "modelId": REPO, "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": name} for name in self.files]}
            return self._send(h, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        if path.startswith(f"{api}/tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                     **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}}
                        if name.endswith(".safetensors") else {})}
                    for name, data in self.files.items()]
            return self._send(h, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        for rev in ("main", COMMIT):
            prefix = f"/{REPO}/resolve/{rev}/"
            if path.startswith(prefix) and path[len(prefix):] in self.files:
                data = self.files[path[len(prefix):]]
                return self._send(h, 200, data, body, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
        self._send(h, 404, b'{"error": "Repository not found"}', body,
                   {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def hub(tiny_llama_smollm2_tokenizer_dir):
    server = FakeHub(tiny_llama_smollm2_tokenizer_dir)
    yield server
    server.close()


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_XET": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    return {**os.environ, **env}


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trellm.cli", *args], env=env, capture_output=True, text=True, timeout=300)


def test_download_then_generate_from_the_cache(hub, hub_env):
    got = _cli(["download", REPO], hub_env)
    assert got.returncode == 0, got.stderr
    snapshot = Path(got.stdout.strip().splitlines()[-1])
    assert snapshot.is_dir() and (snapshot / "model.safetensors").is_file()
    assert Path(hub_env["HF_HOME"]) in snapshot.parents  # inside the Hub cache, where other tools find it
    assert any(r.startswith("GET /" + REPO + "/resolve/") and r.endswith("model.safetensors") for r in hub.requests)

    # -m org/name loads the cached snapshot; offline it needs no server at all
    offline = {**hub_env, "HF_HUB_OFFLINE": "1"}
    got = _cli(["generate", "-m", REPO, "--max-tokens", "4", "--device", "cpu", "Hello"], offline)
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr


def test_hub_errors_are_one_line(hub, hub_env):
    got = _cli(["info", "-m", "tiny-org/no-such-model"], hub_env)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert got.stderr.strip().splitlines()[-1].startswith("error: 'tiny-org/no-such-model' is not a local directory")
    assert "no model by that id" in got.stderr

    got = _cli(["info", "-m", REPO], {**hub_env, "HF_HUB_OFFLINE": "1"})  # nothing cached in this HF_HOME
    assert got.returncode == 2 and "not in the local cache" in got.stderr and "Traceback" not in got.stderr
