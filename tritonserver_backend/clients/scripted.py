"""The main job's scripted conversation (`scripts/main.sh`): routed turns in four domains and one explicit adapter.
The tests and benchmarks that compare a deployment against the single-rank path replay the same turns.

Each item: (adapter named on the request or None for a routed turn, the user's text)."""

from __future__ import annotations

CONVERSATION = [
    (None, "hey, how are you doing tonight?"),
    (None, "import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):\n        yield from files"),
    (None, ".card { display: flex; justify-content: space-between; padding: 1rem; }"),
    (None, "tar -czvf backup.tar.gz --exclude='*.log' /home/user/docs"),
    ("L0_chat", "thanks a lot, you saved my evening!"),
]
