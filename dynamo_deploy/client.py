"""A minimal OpenAI chat client for the deployment (stdlib only): a conversation resends its messages each turn, with
`x-dynamo-session-id` so the frontend keeps it on its encoder worker."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .worker_common import MODEL_NAME


@dataclass
class Conversation:
    url: str
    session_id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    model: str = MODEL_NAME

    def say(self, text: str, max_tokens: int = 24, timeout_s: float = 300.0, **sampling: Any) -> dict[str, Any]:
        """One turn: the reply's message and finish reason (the reply joins the history for the next turn)."""
        self.messages.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": self.messages, "max_tokens": max_tokens, "temperature": 0.0, **sampling}
        req = urllib.request.Request(f"{self.url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "x-dynamo-session-id": self.session_id})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out = json.load(r)
        except urllib.error.HTTPError as exc:
            self.messages.pop()
            raise RuntimeError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
        choice = out["choices"][0]
        self.messages.append({"role": "assistant", "content": choice["message"]["content"] or ""})
        return {"text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"], "usage": out.get("usage")}
