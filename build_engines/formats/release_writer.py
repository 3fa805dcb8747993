"""A release-shaped checkpoint: the release's config file, tensor names, storage dtypes and shards, at small width.

    python -m build_engines release-shaped --out artifacts/release-shaped            # 40 layers, ~25 MB
    python -m build_engines release-shaped --out DIR --dim 512 --experts 64 --force   # a bigger one for memory figures
    python -m build_engines release-shaped --out DIR --adapters                       # + random adapters, to serve it

Why: the released DeepSeek-V4.1-Flash (~1.5 TB) cannot be downloaded or loaded here, yet everything that reads it (the
config translation, the lazy loader, role-bounded builds, Engram, the chat format) must be exercised on exactly its
layout. This writes the same layer roles (40 layers: encoder 0-19 with SWA 0-1, ratio-2 KV sources 2/8/14, layer 20
the ratio-1 source and candidate pool, re-index layers 24/28/32/36; Engram at 1 and 14; three DSpark `mtp.*` blocks),
the official `config.json` keys, the release's storage (fp8 e4m3 32x32 blocks, packed fp4 experts, the Engram tables
fp8 with a ue8m0 scale per 32 along each row, bf16/f32 elsewhere), sharded with `model.safetensors.index.json`, and
the tokenizer files of the embedded default (its vocabulary, so the chat format and Engram's token map are real).
Random weights: this is a format and memory fixture, not a model. Re-running with the same arguments reuses the
directory; `--force` rewrites it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ced.formats.checkpoint import stored_as_released
from ced.formats.release_config import ReleaseExtras, to_release_dict
from ced.model.config import CEDConfig, get_preset
from ced.model.network import Block, CEDNetwork, init_weights

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "embedded" / "mol2-small"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STAMP = "release_shaped.json"


@dataclass(frozen=True)
class ReleaseShape:
    """The widths scaled down; every count that defines a layer role stays the release's."""

    dim: int = 128
    experts: int = 16
    inter: int = 64
    dspark_experts: int = 8
    engram_vocab: int = 1000
    shards: int = 4
    seed: int = 0


def release_shaped_config(shape: ReleaseShape, vocab_size: int,
                          compressed_vocab: int) -> tuple[CEDConfig, ReleaseExtras]:
    """The release's layer roles at `shape`'s widths, with the DSpark/vision description the release's config holds."""
    from types import SimpleNamespace

    from ced.model.engram import engram_table_rows  # the bucket layout fixes each table's rows

    engram = dict(engram_layers=(1, 14), engram_vocab_size=shape.engram_vocab, engram_max_ngram=4, engram_n_heads=4)
    cfg = get_preset("deepseek-v4.1-flash").replace(
        name="release-shaped", vocab_size=vocab_size, dim=shape.dim, n_heads=2, head_dim=64, rope_head_dim=16,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, candidate_topk_blocks=4, index_n_heads=2, index_head_dim=32,
        index_topk=16, n_routed_experts=shape.experts, n_activated_experts=min(6, shape.experts),
        moe_inter_dim=shape.inter, yarn_original_seq_len=4096, yarn_factor=4.0, engram_head_dim=32, engram_pad_id=2,
        engram_compressed_vocab_size=compressed_vocab,
        engram_num_embeddings=engram_table_rows(SimpleNamespace(**engram)),
        **engram,
    )
    extras = ReleaseExtras("fp8", "fp4", {
        "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": vocab_size - 1,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 32,
        "dspark_n_routed_experts": shape.dspark_experts, "dspark_n_activated_experts": 3, "vision_n_layers": 0,
    })
    return cfg, extras


def dspark_tensors(cfg: CEDConfig, extras: ReleaseExtras) -> dict[str, torch.Tensor]:
    """The three DSpark blocks as the release names them (`mtp.{i}.*`): sliding-window blocks with their own MoE,
    the stage-0 projection of the target layers' inputs, the last stage's norm, Markov and confidence heads."""
    n = extras.n_mtp_layers
    rank = int(extras.not_run["dspark_markov_rank"])
    targets = len(extras.not_run["dspark_target_layer_ids"])
    block_cfg = cfg.replace(n_routed_experts=int(extras.not_run["dspark_n_routed_experts"]),
                            n_activated_experts=int(extras.not_run["dspark_n_activated_experts"]), engram_layers=(),
                            engram_num_embeddings=())
    out: dict[str, torch.Tensor] = {}
    for stage in range(n):
        block = Block(block_cfg, 0)  # layer 0's role: sliding window only, as every DSpark block
        init_weights(block)
        for key, value in block.state_dict().items():
            out[f"mtp.{stage}.{key}"] = value
    out["mtp.0.main_proj.weight"] = torch.randn(cfg.dim, cfg.dim * targets) * 0.02
    out["mtp.0.main_norm.weight"] = torch.ones(cfg.dim)
    last = f"mtp.{n - 1}"
    out[f"{last}.norm.weight"] = torch.ones(cfg.dim)
    out[f"{last}.markov_head.embed.weight"] = torch.randn(cfg.vocab_size, rank) * 0.02
    out[f"{last}.markov_head.head.weight"] = torch.randn(cfg.vocab_size, rank) * 0.02
    out[f"{last}.confidence_head.proj.weight"] = torch.randn(1, cfg.dim + rank) * 0.02
    return out


def _stamp(shape: ReleaseShape) -> dict:
    return {"writer": "build_engines.formats.release_writer", "shape": shape.__dict__}


def write_release_shaped(out: Path, shape: ReleaseShape = ReleaseShape(), tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR,
                         force: bool = False) -> Path:
    """Write (or reuse, when the stamp matches) a release-shaped checkpoint directory."""
    stamp_path = out / STAMP
    if not force and stamp_path.exists() and json.loads(stamp_path.read_text()) == _stamp(shape):
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)
    from ced.model.engram import compressed_token_map_from_file

    token_map = compressed_token_map_from_file(out / "tokenizer.json")
    vocab = len(token_map)
    cfg, extras = release_shaped_config(shape, vocab, int(max(token_map)) + 1)
    torch.manual_seed(shape.seed)
    net = CEDNetwork(cfg)
    init_weights(net)
    params = dict(net.state_dict())
    params.update(dspark_tensors(cfg, extras))
    stored: dict[str, torch.Tensor] = {}
    for name in tqdm(sorted(params), desc="quantizing as released", unit="tensor", mininterval=5):
        stored.update(stored_as_released(name, params.pop(name)))
    names = sorted(stored)
    per_shard = -(-len(names) // shape.shards)
    weight_map: dict[str, str] = {}
    for s in tqdm(range(shape.shards), desc="writing shards", unit="shard", mininterval=5):
        part = names[s * per_shard: (s + 1) * per_shard]
        fname = f"model-{s + 1:05d}-of-{shape.shards:05d}.safetensors"
        save_file({k: stored[k] for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(to_release_dict(cfg, extras), indent=4) + "\n")
    stamp_path.write_text(json.dumps(_stamp(shape)) + "\n")
    return out


def write_random_adapters(model_dir: Path, rank: int = 8, seed: int = 0) -> list[Path]:
    """Random LoRA adapters (PEFT layout) for `model_dir`'s decoder, one per default domain, named and described as
    the default's (the router reads each `mol2_description`): what `main.sh --model` needs to serve a checkpoint that
    has no trained adapters. Random like the weights they sit on: they exercise loading, stacking, routing and replay
    on the release's layout; what they answer means nothing. Each targets every Linear an adapter may target."""
    from build_engines.routing.data import ADAPTER_DESCRIPTIONS
    from ced.formats.config_file import load_config
    from ced.lora import decoder_lora_modules, random_adapter_weights, save_adapter
    from ced.model.network import DecoderEngine

    cfg = load_config(model_dir)
    with torch.device("meta"):
        decoder = DecoderEngine(cfg)
    modules = decoder_lora_modules(cfg, decoder)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, description in tqdm(ADAPTER_DESCRIPTIONS.items(), desc="random adapters", unit="adapter"):
        weights = random_adapter_weights(modules, rank, std=0.02, generator=generator)
        out.append(save_adapter(model_dir / "adapters" / name, weights, rank, 2.0 * rank, cfg.name,
                                extra={"mol2_description": description}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m build_engines release-shaped", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dim", type=int, default=ReleaseShape.dim)
    p.add_argument("--experts", type=int, default=ReleaseShape.experts)
    p.add_argument("--inter", type=int, default=ReleaseShape.inter)
    p.add_argument("--shards", type=int, default=ReleaseShape.shards)
    p.add_argument("--seed", type=int, default=ReleaseShape.seed)
    p.add_argument("--force", action="store_true", help="rewrite even when the directory holds this shape already")
    p.add_argument("--adapters", action="store_true", help="also write random LoRA adapters (adapters/, the default's "
                   "names and descriptions), so that `scripts/main.sh --model DIR` can serve it")
    args = p.parse_args(argv)
    shape = ReleaseShape(dim=args.dim, experts=args.experts, inter=args.inter, shards=args.shards, seed=args.seed)
    path = write_release_shaped(args.out, shape, force=args.force)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"release-shaped checkpoint in {path}: {size / 1e6:.1f} MB in {shape.shards} shards")
    if args.adapters:
        written = write_random_adapters(path, seed=args.seed)
        print(f"random adapters: {', '.join(a.name for a in written)} in {path / 'adapters'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
