"""Peak memory per rank of the tensor-parallel reference network against its share of the weights (issue 30).

    .venv/bin/python -m benchmarks parallel-memory [--worlds 1,2,4] [--expert-parallel] [--checkpoint DIR]

Writes (once, or reuses with --checkpoint) a ~96 M-parameter bf16 checkpoint of the small preset's layer roles at a
width where weights dominate (vocab 32768, dim 512, 8 routed experts of 512), then for each world size N spawns N
gloo ranks (`ced.parallel.launch`), each of which loads its shards (`load_parallel_network`, bf16) and runs
one prefill. Every rank reports its own peak RSS (VmHWM from /proc/self/status), its RSS after the imports (before
any tensor data), and the bytes of the parameters it holds. The prediction is

    predicted peak(N, rank) = held bytes(N, rank) + overhead,  overhead = peak(1) - held bytes(1)

i.e. the rank's shard (the sharded weights / N plus the replicated ones) plus what a single process needs besides its
weights (interpreter, torch, gloo, activations, the fp32 head copy the logits are computed with). That last item
shrinks with N too, so ranks of N > 1 should come in slightly *under* the prediction. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

MIB = 1 << 20
PRESET_OVERRIDES = dict(vocab_size=32768, dim=512, n_heads=8, o_groups=4, index_n_heads=4, q_lora_rank=256,
                        o_lora_rank=128, moe_inter_dim=512, n_routed_experts=8, n_activated_experts=2)


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _measure(rank: int, world: int, directory: str, expert_parallel: bool, prompt_len: int) -> dict:
    """One rank: RSS after imports, load the shards in bf16, one prefill, peak RSS."""
    import torch

    from ced.parallel.comm import Comm
    from ced.parallel.network import load_parallel_network

    baseline = _status_kib("VmRSS") * 1024
    net = load_parallel_network(directory, Comm(), expert_parallel=expert_parallel, dtype=torch.bfloat16)
    after_load = _status_kib("VmHWM") * 1024
    tokens = torch.randint(0, net.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = net(tokens).logits
    return dict(rank=rank, baseline=baseline, after_load=after_load, peak=_status_kib("VmHWM") * 1024,
                held=net.held_bytes(), read=net.bytes_read, argmax=int(logits[0, -1].argmax()))


def _write_checkpoint(directory: Path) -> int:
    import torch

    from ced.formats.checkpoint import save_checkpoint
    from ced.model.config import get_preset
    from ced.model.network import CEDNetwork, init_weights

    torch.manual_seed(0)
    net = CEDNetwork(get_preset("mol2-small", **PRESET_OVERRIDES))
    init_weights(net)
    net = net.to(torch.bfloat16)
    save_checkpoint(net, directory)
    return sum(t.numel() * t.element_size() for t in net.state_dict().values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (1 must come first)")
    parser.add_argument("--expert-parallel", action="store_true", help="also measure N > 1 with expert parallelism")
    parser.add_argument("--checkpoint", type=Path, help="reuse (or write) the checkpoint here instead of a temp dir")
    parser.add_argument("--prompt", type=int, default=64, help="prefill length")
    args = parser.parse_args(argv)

    import torch

    from ced.formats.checkpoint import CheckpointFiles
    from ced.parallel.launch import run_ranks

    torch.set_num_threads(1)
    worlds = [int(w) for w in args.worlds.split(",")]
    if worlds[0] != 1:
        parser.error("--worlds must start with 1: the N=1 run measures the overhead the prediction uses")
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.checkpoint or Path(tmp) / "checkpoint"
        if not (directory / "model.safetensors").exists():
            _write_checkpoint(directory)
        files = CheckpointFiles(directory)
        weights = sum(t.nbytes for t in files.tensors.values())
        modes = (False, True) if args.expert_parallel else (False,)
        runs = [(1, False)] + [(n, ep) for n in worlds[1:] for ep in modes]
        rows, overhead, argmax = [], 0, None
        for world, ep in runs:
            results = run_ranks(_measure, world, (str(directory), ep, args.prompt), timeout_s=600)
            for r in results:
                if world == 1:
                    overhead, argmax = r["peak"] - r["held"], r["argmax"]
                predicted = r["held"] + overhead
                rows.append((("TP+EP" if ep else "TP"), world, r, predicted))
                if r["argmax"] != argmax:
                    print(f"warning: N={world} rank {r['rank']} predicts token {r['argmax']}, N=1 predicted {argmax}")
    print(f"checkpoint: {weights / MIB:.1f} MiB of bf16 weights ({weights // 2 / 1e6:.1f} M parameters); "
          f"prefill of {args.prompt} tokens; N=1 overhead (peak - held) = {overhead / MIB:.1f} MiB\n")
    print("| mode | N | rank | weights / N | held (shard + replicated) | read from disk | RSS after imports "
          "| peak after load | predicted peak | peak RSS (VmHWM) | peak - predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, world, r, predicted in rows:
        cells = [weights / world, r["held"], r["read"], r["baseline"], r["after_load"], predicted, r["peak"],
                 r["peak"] - predicted]
        print(f"| {mode} | {world} | {r['rank']} | " + " | ".join(f"{c / MIB:.1f} MiB" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
