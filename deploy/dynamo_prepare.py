"""Prepare the Dynamo graph's shared run folder before a worker or the frontend starts (an init container's job).

    python -m deploy.dynamo_prepare --run-dir /var/lib/mol2/run --model-dir /opt/mol2/embedded/mol2-small

This is what `dynamo_deploy.launcher.Deployment.start` does on one machine before it spawns the processes, split out
because on Kubernetes every pod starts on its own: the frontend's model folder (`<run>/model`: tokenizer, chat
template, config; the encoder registers that path with Dynamo) and the adapter registry (`<run>/registry`) on the
volume all the graph's pods share.

Every encoder, decoder and frontend pod runs it, at the same moment. So each file of the model folder is written to a
temporary name and renamed into place (a pod never reads half a tokenizer.json), only when its content differs, and
the registry is created under `ensure_registry`'s lock (the first pod copies the bundled adapters, the others wait and
find it complete).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import socket
import sys
import tempfile
from pathlib import Path

from dynamo_deploy.tokenizer_files import write_model_folder
from dynamo_deploy.worker_common import MODEL_NAME
from tritonserver_backend.adapters.registry_init import ensure_registry


def prepare(run_dir: Path, model_dir: Path, max_context: int) -> list[str]:
    """Bring ``run_dir``'s model folder and registry up to date; returns the model-folder files it replaced."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "model"
    target.mkdir(exist_ok=True)
    replaced: list[str] = []
    with tempfile.TemporaryDirectory(prefix=".model-", dir=run_dir) as scratch:
        fresh = write_model_folder(model_dir, Path(scratch) / "model", MODEL_NAME, max_context)
        for src in sorted(fresh.iterdir()):
            dst = target / src.name
            if dst.exists() and filecmp.cmp(src, dst, shallow=False):
                continue
            tmp = target / f".{src.name}.{socket.gethostname()}.{os.getpid()}"
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, dst)
            replaced.append(src.name)
    ensure_registry(run_dir / "registry", model_dir)
    return replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--max-context", type=int, default=2048, help="the workers' --max-context")
    args = parser.parse_args(argv)
    replaced = prepare(args.run_dir, args.model_dir, args.max_context)
    print(f"run folder {args.run_dir} ready (model files written: {', '.join(replaced) or 'none, all current'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
