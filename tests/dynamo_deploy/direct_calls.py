"""Call a deployment's worker endpoints directly on Dynamo's request plane, as any process that reaches it could (no
frontend, no key). Run with the Dynamo venv's python and the deployment's environment (its discovery folder):

    .venv-dynamo/bin/python tests/dynamo_deploy/direct_calls.py < calls.json

stdin: a JSON list of {"endpoint": "mol2.encoder.step", "instance": <instance id>, "body": {...}}; stdout: one JSON
list with, per call, {"chunks": [the response's data, ...]} or {"exception": "<type>: <message>"}.
"""

from __future__ import annotations

import asyncio
import json
import sys

from dynamo_deploy.worker_common import make_runtime


async def call_all(calls: list[dict]) -> list[dict]:
    runtime = make_runtime(asyncio.get_running_loop())
    results = []
    for call in calls:
        client = await runtime.endpoint(call["endpoint"]).client()
        await client.wait_for_instances()
        try:
            stream = await client.direct(call["body"], int(call["instance"]))
            results.append({"chunks": [chunk.data() async for chunk in stream]})
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            results.append({"exception": f"{type(exc).__name__}: {exc}"})
    return results


def main() -> None:
    import uvloop

    print(json.dumps(uvloop.run(call_all(json.load(sys.stdin)))))


if __name__ == "__main__":
    main()
