"""OpenAI-compatible HTTP frontend for a running tritonserver (docs/openai.md).

    .venv/bin/python scripts/openai_server.py --triton-url 127.0.0.1:8001 --port 9000
then any OpenAI client: base_url http://127.0.0.1:9000/v1, model "mol2" (MoL2 routing) or "mol2:<adapter>".
"""

from __future__ import annotations

import sys

from openai_frontend.cli import main

if __name__ == "__main__":
    sys.exit(main())
