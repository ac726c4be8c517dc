"""Rendering chat templates that requests send, in a child process with a time and a memory limit.

Jinja's sandbox stops attribute tricks but not work: an 87-byte template of nested loops runs for
hours, a doubling string fills memory, and every distinct template compiled in the server would stay
cached. So a request's template (only with ``--allow-request-chat-template``) is rendered in one
long-lived child process whose address space is capped (``RLIMIT_AS``), which is killed and restarted
when a render passes the time limit, and whose compiled-template cache holds at most
:data:`CACHE_TEMPLATES` entries. The server's own templates never go there; they are trusted and
rendered in a worker thread.
"""
from __future__ import annotations

import multiprocessing
import threading
from typing import Any

CACHE_TEMPLATES = 32


class TemplateLimitError(Exception):
    """The template ran past the time limit or the memory limit."""


class TemplateRenderError(Exception):
    """The template raised (a syntax error, raise_exception, a bad role ...): the request's fault."""


def _serve(conn, memory_mb: int) -> None:
    """The child: render what the parent sends until the pipe closes."""
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from trellm import tokenizer

    while True:
        try:
            template, messages, kwargs = conn.recv()
        except EOFError:
            return
        try:
            text = tokenizer.render_chat_template(template, messages, **kwargs)
            reply: tuple[str, str] = ("ok", text)
        except MemoryError:
            reply = ("memory", "")
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        cache = tokenizer._TEMPLATE_CACHE
        while len(cache) > CACHE_TEMPLATES:  # oldest first: dicts keep insertion order
            cache.pop(next(iter(cache)))
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("memory", ""))


class TemplateSandbox:
    """``render(...)`` blocks the calling thread (never call it on the event loop); one render at a time."""

    def __init__(self, timeout_s: float, memory_mb: int):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None

    def render(self, template: str, messages: list[dict], **kwargs: Any) -> str:
        with self._lock:
            self._start()
            try:
                self._conn.send((template, messages, kwargs))
                ready = self._conn.poll(self.timeout_s)
                status, payload = self._conn.recv() if ready else ("timeout", "")
            except (EOFError, OSError):  # the child died: killed by the memory limit
                status, payload = "memory", ""
            if status == "ok":
                return payload
            if status == "error":
                raise TemplateRenderError(payload)
            self.close()
            if status == "timeout":
                raise TemplateLimitError(f"the chat template did not finish within {self.timeout_s:g} s")
            raise TemplateLimitError(f"the chat template needed more than {self.memory_mb} MiB")

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: forking a process with torch threads is unsafe
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, self.memory_mb), name="trellm-template-sandbox", daemon=True)
        self._process.start()
        child.close()

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._conn.close()
        self._process = self._conn = None


def render_request_template(host: Any, template: str, messages: list[dict], **kwargs: Any) -> str:
    """Render a request's own chat template in the host's sandbox; 400 when request templates are off or a limit is hit."""
    from .errors import bad_request

    sandbox = host.template_sandbox
    if sandbox is None:
        raise bad_request("chat_template in requests is off on this server (the operator can turn it on with "
                          "--allow-request-chat-template)", param="chat_template", code="chat_template_not_allowed")
    try:
        return sandbox.render(template, messages, **kwargs)
    except TemplateLimitError as exc:
        raise bad_request(f"chat_template: {exc}", param="chat_template", code="chat_template_limit") from None
