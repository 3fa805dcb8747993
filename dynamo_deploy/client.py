"""A minimal OpenAI chat client for the deployment: a conversation resends its messages each turn, with
`x-dynamo-session-id` so the frontend keeps it on its encoder worker, and its session token (session_guard.py): every
turn asks for `nvext.engine_data`, where the turn that starts the session returns the token, and presents the token
it holds as an `nvext.annotations` entry."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator

from dynamo_deploy.session_guard import client_nvext, issued_token
from dynamo_deploy.worker_common import MODEL_NAME


def post_chat(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout_s: float = 300.0) -> dict[str, Any]:
    """One non-streamed chat completion request -> the response; an HTTP error is a RuntimeError with its code and
    message."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None


def stream_chat(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                timeout_s: float = 300.0) -> Iterator[dict[str, Any]]:
    """One streamed chat completion request -> its server-sent events, parsed, in arrival order (`[DONE]` ends the
    iteration; an `error` event is yielded like any other). A response other than 200 is a RuntimeError with its code
    and message. Read lazily: a caller may act between events (time them, kill a worker mid-stream)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                           {"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode(errors='replace')[:500]}")
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return
            if line.startswith("data:"):
                yield json.loads(line[5:])
    finally:
        connection.close()


@dataclass
class Conversation:
    url: str
    session_id: str | None  # None: no x-dynamo-session-id (the worker keys the conversation by its history)
    messages: list[dict[str, str]] = field(default_factory=list)
    model: str = MODEL_NAME
    session_token: str | None = None  # issued on the turn that started the session; a later issue replaces it
    annotations: list[str] = field(default_factory=list)  # more nvext.annotations for every turn (mol2-speculative:off)

    def _headers(self) -> dict[str, str]:
        return {"content-type": "application/json",
                **({"x-dynamo-session-id": self.session_id} if self.session_id else {})}

    def _nvext(self) -> dict[str, Any]:
        nvext = client_nvext(self.session_token)
        if self.annotations:
            nvext["annotations"] = [*nvext.get("annotations", []), *self.annotations]
        return nvext

    def _take_token(self, nvext: dict[str, Any] | None) -> None:
        token = issued_token(nvext)
        if token:
            self.session_token = token

    def say(self, text: str, max_tokens: int = 24, timeout_s: float = 300.0, **sampling: Any) -> dict[str, Any]:
        """One turn: the reply's message and finish reason (the reply joins the history for the next turn)."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, "max_tokens": max_tokens, "temperature": 0.0,
                "nvext": self._nvext(), **sampling}
        try:
            out = post_chat(self.url, body, self._headers(), timeout_s)
        except RuntimeError:
            self.messages.pop()
            raise
        self._take_token(out.get("nvext"))
        choice = out["choices"][0]
        self.messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
        return {"text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"],
                "usage": out.get("usage")}

    def leave_mid_stream(self, text: str, after_chunks: int, max_tokens: int = 256, timeout_s: float = 300.0) -> str:
        """A streamed turn whose client disconnects after `after_chunks` content chunks: -> the text it received. The
        user message stays in `messages`; what the assistant message should be is the caller's choice (the server
        keeps the partial reply it generated, which may be longer than what reached the client)."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "nvext": self._nvext()}
        url = urllib.parse.urlparse(self.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), self._headers())
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode(errors='replace')[:500]}")
        received, chunks = [], 0
        while chunks < after_chunks:
            line = response.fp.readline().decode()
            if not line:
                break
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            self._take_token(event.get("nvext"))
            delta = event["choices"][0].get("delta", {}).get("content") or ""
            if delta:
                received.append(delta)
                chunks += 1
        conn.sock.shutdown(socket.SHUT_RDWR)  # leave: the frontend sees the connection close mid-stream
        conn.close()
        return "".join(received)
