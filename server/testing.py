"""Run the real server on loopback inside this process (tests, benchmarks): uvicorn in a thread on a free port."""
from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

from .config import ServerConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """``with ServerThread(config) as server:`` serves ``config`` on 127.0.0.1 until the block ends.

    ``server.url`` is the base URL (``http://127.0.0.1:PORT``); ``server.app.state.host`` the
    :class:`~trellm.server.engine.ModelHost` (generator and cache accounting for tests).
    """

    def __init__(self, config: ServerConfig, port: int | None = None, ready_timeout_s: float = 300.0,
                 log_level: str = "warning"):
        from .app import create_app
        from .http import serve

        # Loopback only, on ``port`` or a free one (config.host/port are ignored: tests never listen outside).
        self.config = config.updated({"host": "127.0.0.1", "port": port or free_port()}, "ServerThread")
        self.app = create_app(self.config)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.ready_timeout_s = ready_timeout_s
        self.server = serve(self.app, self.config, host="127.0.0.1", port=self.config.port, log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, name="trellm-server", daemon=True)

    @property
    def host(self):
        return self.app.state.host

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except urllib.error.HTTPError as e:
                if e.code == 503 and self.host.state == "failed":
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"model failed to load: {self.host.error}") from None
            except OSError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server at {self.url} not ready after {self.ready_timeout_s}s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
