"""`python -m openai_frontend` (and `scripts/openai_server.py`): the OpenAI-compatible frontend on one port, forwarding
to a running tritonserver's gRPC port."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from openai_frontend.admission import DEFAULT_PER_KEY

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET = 2 << 30  # the server's session_budget_bytes default (tritonserver_backend.repository)
DEFAULT_MAX_CONTEXT = 8192  # the server's max_context default (tritonserver_backend.repository)
API_KEY_ENV = "MOL2_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openai_server", description=__doc__.splitlines()[0])
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver's gRPC address host:port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model-dir", type=Path, default=ROOT / "embedded" / "mol2-small",
                   help="the served model's folder: its tokenizer counts prompt tokens, its config sizes sessions")
    p.add_argument("--cache-budget-bytes", type=int, default=DEFAULT_BUDGET,
                   help="bound of the conversation-prefix cache, in server session bytes (use the server's "
                        "session_budget_bytes)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_CONTEXT,
                   help="the server's max_context, as /tokenize reports it")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer <key>' on every route but /health and /metrics; repeat it for "
                        "several keys (one per tenant: each key has its own partition of the conversation cache; "
                        f"default: ${API_KEY_ENV}, a comma-separated list; unset: no authentication)")
    p.add_argument("--max-in-flight-per-key", type=int, default=DEFAULT_PER_KEY,
                   help="with API keys: the most requests one key may have in flight (a streamed reply counts until "
                        "its last event); one more is answered 429 with Retry-After, so one tenant cannot take every "
                        "turn slot of the server (default 48: half its default 96); 0: no bound")
    p.add_argument("--health-url", default=None,
                   help="the tritonserver supervisor's health address (scripts/tritonserver.py start prints it, e.g. "
                        "http://127.0.0.1:8003/health): a 503 then names the model whose process died and says the "
                        "server is healing")
    p.add_argument("--auto-tool-grammar", action=argparse.BooleanOptionalAction, default=True,
                   help="with tool_choice auto, hold a call the model begins to an offered tool and its schema (an "
                   "xgrammar structural tag; text before it stays free); --no-auto-tool-grammar parses calls as "
                   "written")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[str]:
    """The accepted API keys: every `--api-key`, else ${API_KEY_ENV} split at commas (blanks dropped); [] for none.
    An empty `--api-key` is an error (it would accept a bare 'Bearer ')."""
    if args.api_key is not None:
        keys = [k.strip() for k in args.api_key]
        if not all(keys):
            raise SystemExit("openai_server: --api-key needs a non-empty key")
    else:
        keys = [k.strip() for k in (os.environ if environ is None else environ).get(API_KEY_ENV, "").split(",")]
    return list(dict.fromkeys(k for k in keys if k))


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ced.text.tokenizer import ChatTokenizer
    from openai_frontend.app import create_app
    from openai_frontend.prefix_cache import PrefixCache
    from openai_frontend.service import ChatService
    from openai_frontend.session_cost import SessionCost
    from openai_frontend.triton_stream import TritonStream

    cache = PrefixCache(args.cache_budget_bytes, SessionCost.of_model(args.model_dir))
    tokenizer = ChatTokenizer.load(args.model_dir)
    tokenizer.chat_format  # noqa: B018 - prompts are counted in the directory's chat format: none fails at start, not per request
    stream = TritonStream(args.triton_url, args.health_url)
    return create_app(ChatService(stream, tokenizer, cache, args.max_model_len, args.auto_tool_grammar), api_keys(args),
                      args.max_in_flight_per_key)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    app = build(args)
    n = len(api_keys(args))
    auth = f"API key required ({n} key{'s' * (n != 1)})" if n else "no API key (any Authorization is accepted)"
    print(f"OpenAI frontend on http://{args.host}:{args.port}/v1 -> tritonserver gRPC {args.triton_url}; {auth}",
          flush=True)
    # grpc.aio needs asyncio's loop
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop="asyncio")
    return 0
