"""Peak memory of reading and building a release-shaped checkpoint, per role, against that role's checkpoint bytes.

    .venv/bin/python -m benchmarks release-memory --out docs/release_memory.md [--dim 256 --experts 32]

Writes (or reuses) a release-shaped checkpoint (`python -m build_engines release-shaped`), then runs every measurement
in a fresh child process and reads that child's own peak RSS (`ru_maxrss`), so one measurement never inherits
another's pages:

- `fixed`: the fixed overhead (Python, torch, our modules, the shard headers read and the network skeleton built on
  the meta device, which costs ~140 MB once: torch's first module construction), no tensor data read;
- `stored:<role>`: the role's tensors as stored (fp8/fp4 + scales), what a builder keeping the release's formats reads;
- `fp32:<role>`: the role loaded into the PyTorch component, dequantized to fp32 tensor by tensor;
- `--build`: `python -m build_engines build` of a release-shaped checkpoint per entry of `--builds` (the bounded,
  stored-weight build: one process per role and phase, each recording its own VmHWM in the manifest). Each build
  is `DIMxINTERxEXPERTS`; `--builds 256x128x16,1024x512x16` keeps the release's inter / dim of 0.5, so the weights
  grow faster than what scales with the shape rather than the bytes (the check's activations, rounding taps and
  random LoRA bank), as at full size, while the interpreter and the tracer's 40-layer graph stay the same. The smallest
  build states the fixed overhead per role and phase (its peak minus one copy of the role's bytes); every larger build
  is then checked against `fixed + 1.25 x role bytes`, and the slope between the smallest and the largest (extra peak
  per extra role byte) is printed.

The table gives each figure beside `fixed + 1.25 x role bytes`, the bound issue 29 sets for builds, and the full-size
figures of the release by arithmetic (its role bytes from the published tensor list and storage formats).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import ROOT

CHILD = r"""
import json, sys, time
t0 = time.time()
import torch, safetensors  # noqa: F401
from ced.formats import checkpoint
kind, path = sys.argv[1], sys.argv[2]
if kind.startswith("stored:"):
    tensors = checkpoint.read_role_stored(path, kind.split(":")[1])
    held = sum(t.numel() * t.element_size() for t in tensors.values())
elif kind.startswith("fp32:"):
    module = checkpoint.load_checkpoint(path, role=kind.split(":")[1])
    held = sum(p.numel() * p.element_size() for p in module.state_dict().values())
else:  # the fixed part: headers read, names checked, the network skeleton built on the meta device; no data
    from ced.formats.config_file import load_config
    checkpoint._audit_names(checkpoint.CheckpointFiles(path), load_config(path))
    held = 0
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": hwm * 1024, "held": held, "seconds": time.time() - t0}))
"""
# VmHWM, not ru_maxrss: Linux carries a parent's high-water mark into an exec'd child's ru_maxrss, VmHWM is the
# child's own address space only.


def child(kind: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path)], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_peaks(path: Path, engines: Path, force: bool, chunk_bytes: int | None) -> dict:
    """The engine build in a child (the CLI; its own VmHWM printed by a wrapper) and, from its manifest, each role
    process's own VmHWM (export and check phases) with the role's stored bytes. Without `force` an engine directory
    that is current for this checkpoint and builder code is reused, with the figures its build recorded."""
    wrapper = ("import sys, json; from build_engines.build.cli import main; "
               "rc = main(['--model', sys.argv[1], '--out', sys.argv[2]] + sys.argv[3:]); "
               "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')); "
               "print(json.dumps({'rc': rc, 'peak_rss': hwm * 1024}))")
    t0 = time.time()
    extra = ((["--force"] if force else [])
             + (["--expert-chunk-bytes", str(chunk_bytes)] if chunk_bytes is not None else []))
    out = subprocess.run([sys.executable, "-c", wrapper, str(path), str(engines)] + extra,
                         capture_output=True, text=True, cwd=ROOT)
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"rc": out.returncode}
    result["seconds"] = time.time() - t0
    if result.get("rc"):
        err = [line for line in out.stderr.splitlines() if line.startswith("error")]
        result["error"] = err[-1] if err else out.stderr.strip()[-300:]
        return result
    manifest = json.loads((engines / "manifest.json").read_text())
    result["reused"] = "reusing them" in out.stdout
    if result["reused"]:
        result["seconds"] = manifest["build_seconds"]
    result["roles"] = {role: manifest["graphs"][role]["weights"]
                       | {"data_bytes": manifest["graphs"][role].get("data_bytes", 0)}
                       for role in ("encoder", "decoder")}
    return result


PHASES = ("export", "graph_run", "check")  # the role's export, its graph run (onnxruntime), its module run


def build_table(checkpoint_root: Path, builds: list[tuple[int, int, int]], force: bool,
                chunk_bytes: int | None) -> list[str]:
    """Build each (dim, inter, experts) checkpoint and tabulate every role process's peak against the bound (see the
    docstring)."""
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    mb = 1e6
    runs = []
    for dim, inter, experts in builds:
        name = f"release-shaped-w{dim}x{inter}e{experts}"
        path = write_release_shaped(checkpoint_root / name, ReleaseShape(dim=dim, experts=experts, inter=inter))
        print(f"building the release-shaped checkpoint at dim {dim}, inter {inter}, {experts} experts ...", flush=True)
        runs.append((dim, inter, experts, build_peaks(path, ROOT / "artifacts" / "engines" / name, force, chunk_bytes)))
    failed = [f"dim {d} inter {i} experts {e}: {r['error']}" for d, i, e, r in runs if "error" in r]
    if failed:
        return ["", "## Engine build", "", "Failed: " + "; ".join(failed)]
    chunk_text = ("`--expert-chunk-bytes 1`: one expert per chunk, as the release's 100 MB experts give at the default"
                  if chunk_bytes == 1 else f"chunks of at most {chunk_bytes or 16 << 20} fp32 bytes")
    base = runs[0][3]["roles"]
    fixed = {(role, phase): base[role][f"{phase}_peak_rss_bytes"] - base[role]["role_checkpoint_bytes"]
             for role in ("encoder", "decoder") for phase in PHASES}
    lines = ["", "## Engine build (bounded: the weights as stored)", "",
             "`python -m build_engines build` of 40-layer release-shaped checkpoints, one per row group. Each role's "
             "export, graph run (onnxruntime on the check inputs) and module check run in processes of their own; the "
             "figure is that process's VmHWM (recorded in the manifest, `graphs.<role>.weights`). The fixed overhead "
             "per role and phase is the first build's peak minus one copy of its role bytes (Python, torch, the "
             "exporter's 40-layer graph, onnxruntime, the check's activations and rounding taps, the head and one "
             f"expert chunk dequantized in flight, {chunk_text}):"
             + ";".join(f" {role} {phase} {fixed[(role, phase)] / mb:.0f} MB" for role in ("encoder", "decoder")
                        for phase in PHASES) + ".",
             "",
             "| dim x inter | experts | role | role bytes MB | engine data MB | phase | peak RSS MB | bound: fixed + "
             "1.25 x role MB | within | orchestrator peak MB | build s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dim, inter, experts, r in runs:
        orchestrator = "reused" if r["reused"] else f"{r['peak_rss'] / mb:.0f}"
        for role in ("encoder", "decoder"):
            w = r["roles"][role]
            for phase in PHASES:
                peak = w[f"{phase}_peak_rss_bytes"]
                bound = fixed[(role, phase)] + 1.25 * w["role_checkpoint_bytes"]
                lines.append(f"| {dim} x {inter} | {experts} | {role} | {w['role_checkpoint_bytes'] / mb:.1f} | "
                             f"{w['data_bytes'] / mb:.1f} | {phase} | {peak / mb:.0f} | {bound / mb:.0f} | "
                             f"{'yes' if peak <= bound else 'no'} | {orchestrator} | {r['seconds']:.0f} |")
    if len(runs) > 1:
        top = runs[-1][3]["roles"]
        lines += ["", "Slope from the smallest to the largest build (extra peak RSS per extra role byte; the bound "
                      "allows 1.25):"]
        for role in ("encoder", "decoder"):
            extra = top[role]["role_checkpoint_bytes"] - base[role]["role_checkpoint_bytes"]
            for phase in PHASES:
                rise = top[role][f"{phase}_peak_rss_bytes"] - base[role][f"{phase}_peak_rss_bytes"]
                lines.append(f"- {role} {phase}: {rise / extra:.2f}")
    return lines


def role_bytes(path: Path) -> dict[str, int]:
    from ced.formats.checkpoint import CheckpointFiles, role_tensor_names
    from ced.formats.config_file import load_config

    files, cfg = CheckpointFiles(path), load_config(path)
    out = {role: files.bytes_of(role_tensor_names(cfg, role)) for role in ("encoder", "decoder")}
    out["checkpoint"] = sum(t.nbytes for t in files.tensors.values())
    return out


def full_size_arithmetic() -> list[tuple[str, float]]:
    """The release's bytes per role, from the published tensor list and each tensor's storage format."""
    import math

    from ced.formats.release_format import Storage, published_flash_tensors, storage_of

    def stored(name: str, shape: tuple[int, ...]) -> float:
        n = math.prod(shape)
        s = storage_of(name)
        if s is Storage.FP8_BLOCKS:
            return n + math.ceil(shape[0] / 32) * math.ceil(shape[1] / 32)
        if s is Storage.FP4_PACKED:
            return n / 2 + shape[0] * shape[1] / 32
        return n * (4 if s is Storage.F32 else 2)

    enc = dec = 0.0
    for name, shape in published_flash_tensors().items():
        b = stored(name, shape)
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        encoder_side = name == "embed.weight" or (layer is not None and (layer < 20 or (
            layer == 20 and ".ffn" not in name and "ffn_norm" not in name and "hc_ffn" not in name)))
        if encoder_side:
            enc += b
        else:
            dec += b
    engram_rows = 384006168 + 384016682
    engram = engram_rows * 256 + engram_rows * 8  # fp8 rows + one ue8m0 scale per 32
    return [("encoder role (backbone)", enc), ("decoder role", dec), ("Engram tables (host, memory-mapped)", engram)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "artifacts" / "release-shaped-memory")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--build", action="store_true", help="also measure the ONNX engine build of each of --builds")
    p.add_argument("--builds", default="256x128x16,1024x512x16",
                   help="dim x inter x routed experts of each build, smallest first (comma list)")
    p.add_argument("--expert-chunk-bytes", type=int, default=None,
                   help="passed to the builds (1: one expert per chunk, as the release's 100 MB experts give at the "
                   "default)")
    p.add_argument("--force-build", action="store_true", help="rebuild engine directories that are current")
    p.add_argument("--out", type=Path, default=None, help="markdown file to write (e.g. docs/release_memory.md)")
    args = p.parse_args()
    from build_engines.formats.release_writer import ReleaseShape, write_release_shaped

    shape = ReleaseShape(dim=args.dim, experts=args.experts, inter=args.inter)
    path = write_release_shaped(args.checkpoint, shape)
    sizes = role_bytes(path)
    fixed = child("fixed", path)
    rows = []
    for kind in ("stored:encoder", "stored:decoder", "fp32:encoder", "fp32:decoder"):
        r = child(kind, path)
        r["kind"] = kind
        rows.append(r)
    mb = 1e6
    build_args = (f" --build --builds {args.builds}"
                  + (f" --expert-chunk-bytes {args.expert_chunk_bytes}" if args.expert_chunk_bytes else "")
                  if args.build else "")
    lines = [
        "# Memory of reading and building a release-shaped checkpoint",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on this machine (2 CPU cores) by "
        f"`benchmarks/release_memory.py --dim {args.dim} --experts {args.experts} --inter "
        f"{args.inter}{build_args}`. Checkpoint: 40 layers (+3 DSpark blocks, Engram at 1 and 14), "
        f"{sizes['checkpoint'] / mb:.1f} MB stored; encoder role {sizes['encoder'] / mb:.1f} MB, decoder role "
        f"{sizes['decoder'] / mb:.1f} MB (stored bytes of the role's tensors with their scales).",
        "",
        "Fixed overhead (Python + torch + our modules + headers + the network skeleton on the meta device, no tensor "
        f"data): {fixed.get('peak_rss', 0) / mb:.0f} MB peak RSS.",
        "",
        "| measurement | peak RSS MB | above fixed MB | role bytes MB | bound: fixed + 1.25 x role MB | within | held "
        "MB | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        role = r["kind"].split(":")[1] if ":" in r["kind"] else None
        share = sizes[role] if role else sizes["encoder"] + sizes["decoder"]
        if "error" in r:
            lines.append(f"| {r['kind']} | failed: {r['error'][:150]} | | {share / mb:.1f} | | | | |")
            continue
        bound = fixed["peak_rss"] + 1.25 * share
        lines.append(f"| {r['kind']} | {r['peak_rss'] / mb:.0f} | {(r['peak_rss'] - fixed['peak_rss']) / mb:.0f} | "
                     f"{share / mb:.1f} | {bound / mb:.0f} | {'yes' if r['peak_rss'] <= bound else 'no'} | "
                     f"{r.get('held', 0) / mb:.1f} | {r['seconds']:.1f} |")
    if args.build:
        builds = [tuple(int(v) for v in b.split("x")) for b in args.builds.split(",")]
        lines += build_table(args.checkpoint.parent, builds,  # type: ignore[arg-type]
                             args.force_build, args.expert_chunk_bytes)
    lines += ["", "## Full size, by arithmetic", "", "| part | stored GB |", "|---|---|"]
    for name, b in full_size_arithmetic():
        lines.append(f"| {name} | {b / 1e9:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
