"""Multi-turn chat with a running server (gRPC streaming or HTTP), printing the adapter chosen each turn.

    .venv/bin/python scripts/chat.py --url 127.0.0.1:8001                 # interactive, gRPC
    .venv/bin/python scripts/chat.py --http --url 127.0.0.1:8000 -m "hi" -m "def f(): ..."
Prefix a line with @NAME (e.g. "@L2_code write a loop") to name the adapter explicitly; "@base" for none.
"""

from __future__ import annotations

import argparse
import sys
import uuid

from tritonserver_backend.client import GrpcChat, HttpChat, TurnRequest


def parse_line(line: str) -> tuple[str | None, str]:
    if line.startswith("@") and " " in line:
        name, text = line[1:].split(" ", 1)
        return name, text
    return None, line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="host:port (the gRPC port, or the HTTP port with --http)")
    p.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC streaming")
    p.add_argument("-m", "--message", action="append", help="scripted turns (otherwise read stdin line by line)")
    p.add_argument("--session", default=None)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    chat = HttpChat(args.url) if args.http else GrpcChat(args.url)
    session = args.session or f"chat-{uuid.uuid4().hex[:8]}"
    lines = args.message or (line.rstrip("\n") for line in sys.stdin)
    first = True
    for line in lines:
        if not line.strip():
            continue
        adapter, text = parse_line(line)
        print(f"\nuser{' @' + adapter if adapter else ''}: {text}")
        print("assistant: ", end="", flush=True)
        reply = chat.turn(TurnRequest(session, text, new_session=first, adapter=adapter, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed), on_piece=lambda s: print(s, end="", flush=True))
        first = False
        if reply.error:
            print(f"\n[error] {reply.error}")
            continue
        how = "explicit" if adapter else "routed"
        print(f"\n  [adapter {reply.adapter} ({how}); {len(reply.token_ids)} tokens; finish: {reply.finish_reason}]")
    if isinstance(chat, GrpcChat):
        chat.close()


if __name__ == "__main__":
    main()
