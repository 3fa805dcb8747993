"""Hand-over-sized payloads between two Dynamo processes: inline (base64 in the response, what the deployment
uses) against NIXL (`dynamo.nixl_connect`: the producer registers the buffer and returns its RDMA metadata, the
consumer reads it memory to memory through UCX). Decides where NIXL pays; prints a markdown table.

  .venv-dynamo/bin/python -m dynamo_deploy.nixl_bench
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dynamo_deploy.worker_common import discovery_env, make_runtime

SIZES = [4_824, 64_320, 1 << 20, 8 << 20, 32 << 20]  # one token's row, one turn's rows (measured), then rebuild-sized
REPEATS = 5
PATH = "mol2bench.producer.fetch"


async def produce() -> None:
    import dynamo.nixl_connect as nc

    runtime = make_runtime(asyncio.get_running_loop())
    connector = nc.Connector()
    buffers = {n: np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8) for n in SIZES}

    async def fetch(request, context):  # type: ignore[no-untyped-def]
        data = buffers[int(request["bytes"])]
        if request["mode"] == "inline":
            yield {"b64": base64.b64encode(data.tobytes()).decode()}
            return
        readable = await connector.create_readable(nc.Descriptor((data, "cpu")))
        yield {"meta": readable.metadata().model_dump()}
        await readable.wait_for_completion()

    await runtime.endpoint(PATH).serve_endpoint(fetch)


async def consume() -> list[tuple[int, str, float]]:
    import dynamo.nixl_connect as nc

    runtime = make_runtime(asyncio.get_running_loop())
    client = await runtime.endpoint(PATH).client()
    await client.wait_for_instances()
    connector = nc.Connector()
    results = []
    for n in SIZES:
        for mode in ("inline", "nixl"):
            times = []
            for _ in range(REPEATS + 1):  # the first call of each kind sets up connections: not counted
                t0 = time.perf_counter()
                stream = await client.round_robin({"bytes": n, "mode": mode})
                async for chunk in stream:
                    data = chunk.data()
                    if mode == "inline":
                        got = np.frombuffer(base64.b64decode(data["b64"]), np.uint8)
                    else:
                        got = np.empty(n, np.uint8)
                        op = await connector.begin_read(nc.RdmaMetadata.model_validate(data["meta"]),
                                                        nc.Descriptor((got, "cpu")))
                        await op.wait_for_completion()
                    break
                times.append(time.perf_counter() - t0)
                assert got.size == n and got[:8].tolist() == np.random.default_rng(n).integers(
                    0, 255, n, dtype=np.uint8)[:8].tolist()
            results.append((n, mode, float(np.median(times[1:]))))
            print(f"{n:>10d} B {mode:6s} {1e3 * results[-1][2]:8.2f} ms", flush=True)
    return results


def main() -> int:
    import uvloop

    if sys.argv[1:] == ["produce"]:
        uvloop.run(produce())
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **discovery_env(Path(tmp))}
        os.environ.update(discovery_env(Path(tmp)))
        producer = subprocess.Popen([sys.executable, "-m", "dynamo_deploy.nixl_bench", "produce"], env=env)
        try:
            results = uvloop.run(consume())
        finally:
            producer.terminate()
            producer.wait(10)
    print("\n| payload | inline (base64 over the request plane) | NIXL (UCX, memory to memory) |\n|---|---|---|")
    by = {(n, m): t for n, m, t in results}
    for n in SIZES:
        print(f"| {n:,} B | {1e3 * by[(n, 'inline')]:.2f} ms | {1e3 * by[(n, 'nixl')]:.2f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
