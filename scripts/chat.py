"""Multi-turn chat with a running server: the tensor API (gRPC streaming or HTTP) or the OpenAI frontend (--openai).

    .venv/bin/python scripts/chat.py --url 127.0.0.1:8001                       # interactive, gRPC
    .venv/bin/python scripts/chat.py --http --url 127.0.0.1:8000 -m "hi" -m "def f(): ..."
    .venv/bin/python scripts/chat.py --openai --url http://127.0.0.1:9000/v1    # through the OpenAI frontend
Prefix a line with @NAME (e.g. "@L2_code write a loop") to name the adapter explicitly; "@base" for none.
Commands: /help, /new (start a new conversation), /adapters (list the loaded adapters), /quit.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Callable

from tritonserver_backend.clients.client import GrpcChat, HttpChat, TurnRequest

HELP = """commands:
  /help       this text
  /new        start a new conversation (the server forgets nothing else)
  /adapters   list the loaded adapters (model ids with --openai)
  /quit       leave (also Ctrl-D)
  @NAME text  send `text` to adapter NAME (e.g. @L2_code, @base); without it MoL2 routes the turn"""


def parse_line(line: str) -> tuple[str | None, str]:
    if line.startswith("@") and " " in line:
        name, text = line[1:].split(" ", 1)
        return name, text
    return None, line


class TensorChat:
    """The tensor API: one server session per conversation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.chat = HttpChat(args.url) if args.http else GrpcChat(args.url)
        self.new()

    def new(self) -> None:
        self.session, self.first = f"chat-{uuid.uuid4().hex[:8]}", True

    def adapters(self) -> list[str]:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        from tritonserver_backend import contract as c

        mod = httpclient if self.args.http else grpcclient
        client = mod.InferenceServerClient(self.args.url)
        inp = mod.InferInput(c.ACTION.name, [1], "BYTES")
        import numpy as np

        inp.set_data_from_numpy(np.array([b"list"], dtype=np.object_))
        result = client.infer(c.ADMIN.name, [inp]).as_numpy(c.RESULT.name).reshape(-1)[0]
        return [a["name"] for a in json.loads(result)["adapters"]]

    def turn(self, adapter: str | None, text: str, on_piece: Callable[[str], None]) -> tuple[str | None, str, int, str]:
        a = self.args
        reply = self.chat.turn(TurnRequest(self.session, text, new_session=self.first, adapter=adapter,
                                           max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed),
                               on_piece=on_piece)
        if reply.error is None:
            self.first = False
        elif isinstance(self.chat, GrpcChat):  # a stream that saw an error is over (the server may have restarted):
            self.chat.close()  # the next turn opens a new one, and the session goes on with the tokens already held
            self.chat = GrpcChat(self.args.url, self.chat.tokens)
        return reply.error, reply.adapter, len(reply.token_ids), reply.finish_reason

    def close(self) -> None:
        if isinstance(self.chat, GrpcChat):
            self.chat.close()


class OpenAIChat:
    """The OpenAI frontend with the `openai` client: the whole message list each turn (the frontend reuses the
    session)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import openai

        self.args, self.openai = args, openai
        self.client = openai.OpenAI(base_url=args.url, api_key="unused")
        self.new()

    def new(self) -> None:
        self.messages: list[dict] = []

    def adapters(self) -> list[str]:
        return [m.id for m in self.client.models.list().data]

    def turn(self, adapter: str | None, text: str, on_piece: Callable[[str], None]) -> tuple[str | None, str, int, str]:
        a = self.args
        messages = [*self.messages, {"role": "user", "content": text}]
        model = f"mol2:{adapter}" if adapter else "mol2"
        try:
            stream = self.client.chat.completions.create(model=model, messages=messages, max_tokens=a.max_tokens,
                                                         temperature=a.temperature, seed=a.seed, stream=True,
                                                         stream_options={"include_usage": True})
            pieces, used, finish, tokens = [], "", "", 0
            for chunk in stream:
                used = (chunk.model_extra or {}).get("adapter", used)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                        on_piece(choice.delta.content)
                    finish = choice.finish_reason or finish
        except self.openai.APIError as exc:
            return str(exc), "", 0, ""
        self.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]
        return None, used, tokens, finish

    def close(self) -> None:
        self.client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None,
                   help="host:port (the gRPC port, or the HTTP port with --http); the base URL with --openai")
    p.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC streaming")
    p.add_argument("--openai", action="store_true",
                   help="talk to the OpenAI frontend (scripts/openai_server.py) with the openai client")
    p.add_argument("-m", "--message", action="append", help="scripted turns (otherwise read stdin line by line)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.url = args.url or ("http://127.0.0.1:9000/v1" if args.openai else "127.0.0.1:8001")
    chat: TensorChat | OpenAIChat = OpenAIChat(args) if args.openai else TensorChat(args)
    interactive = not args.message and sys.stdin.isatty()
    if interactive:
        print("type /help for commands")
    lines = args.message or (line.rstrip("\n") for line in sys.stdin)
    try:
        for line in lines:
            if not line.strip():
                continue
            command = line.strip().lower()
            if command in ("/quit", "/exit"):
                break
            if command == "/help":
                print(HELP)
                continue
            if command == "/new":
                chat.new()
                print("[new conversation]")
                continue
            if command == "/adapters":
                print("adapters: " + ", ".join(chat.adapters()))
                continue
            if command.startswith("/"):
                print(f"unknown command {line.split()[0]!r}; /help lists them")
                continue
            adapter, text = parse_line(line)
            print(f"\nuser{' @' + adapter if adapter else ''}: {text}")
            print("assistant: ", end="", flush=True)
            error, used, tokens, finish = chat.turn(adapter, text, lambda s: print(s, end="", flush=True))
            if error:
                print(f"\n[error] {error}")
                continue
            how = "explicit" if adapter else "routed by MoL2"
            print(f"\n  [adapter {used} ({how}); {tokens} tokens; finish: {finish}]")
    finally:
        chat.close()


if __name__ == "__main__":
    main()
