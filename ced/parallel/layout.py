"""Which slice of every `CEDNetwork` parameter a rank holds under tensor (and optionally expert) parallelism.

The layout is pure integers and names (no torch, no process group), so a loader, a memory planner and the tests read
one definition. It follows DeepSeek's own V4.1 inference code (`inference/model.py`), which places its collectives
right after the row-parallel projections, and vLLM's flags (`tensor_parallel_size`, `enable_expert_parallel`):

- vocabulary-parallel embedding and head: rows (token ids) split evenly; the embedding all-reduces a masked lookup,
  the head all-gathers the logits;
- attention: the query heads (`wq_b` rows, `attn_sink`) and the output groups (`wo_a` rows, by `o_groups`) are split,
  `wo_b` is row-parallel (its input columns are split, an all-reduce follows). V4.1 has ONE shared K=V latent per
  token (`wkv`, `kv_norm`, the compressor), so there is no KV head axis to split: those, `wq_a`/`q_norm` (the query
  LoRA down-projection every head reads) and the sliding-window/global caches are replicated, as in the release;
- the lightning indexer: its query heads (`wq_b` rows, `weights_proj` rows) are split and the per-head ReLU scores
  are all-reduced before top-k (the release does the same); its key path (`wk`, `k_norm`) is replicated;
- MoE: the gate is replicated (every rank routes every token identically). Tensor parallel slices the shared expert
  and every routed expert along the intermediate dim (w1/w3 rows, w2 columns). With `expert_parallel` each routed
  expert is owned whole by one rank in contiguous blocks, rank r owning experts [r*E/N, (r+1)*E/N) (what the
  release's own code uses, so its per-rank expert files map one to one; round-robin would spread neighbouring hot
  experts but nothing in V4.1's router says neighbours are correlated), and the shared expert is owned whole by rank
  0. The release slices the shared expert there too; we keep it whole because the step engines compute a rank's
  experts as one dense GEMM over experts of one width (`graph_ops.DenseExperts`), and a 1/N shared slice beside
  whole routed experts would break that. It costs rank 0 one expert more (1/(E+1) of a MoE layer: 1/257 in V4.1);
- Engram tables: rows split in ceil(rows/N) chunks (table sizes are sums of primes, never divisible), masked lookup
  and all-reduce as the release does; the Engram gate (`wkv`, `q_weight`, `k_weight`) is replicated;
- everything without a head, vocabulary, expert or intermediate axis (norms, hyper-connection mixers) is replicated.

An unknown parameter name is an error rather than silently replicated, so a new parameter gets a decision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ced.model.config import CEDConfig

#: The release's activation fake-quant reads GEMM inputs in blocks of this many values along K; a row-parallel slice
#: of K must hold whole blocks or the per-rank quantization differs from the single-process one.
ACT_QUANT_BLOCK = 32

Kind = Literal["replicated", "split", "owned"]

#: The rank that holds the shared expert whole under expert parallelism (see the module docs).
SHARED_EXPERT_OWNER = 0


class ParallelLayoutError(ValueError):
    """A parallel size the config cannot be split by; the message names every offending config key."""


@dataclass(frozen=True)
class Shard:
    """How one parameter is distributed, seen from one rank.

    replicated: every rank holds the whole tensor. split: this rank holds [start, stop) along `dim`. owned: one rank
    (`owner`) holds the whole tensor, the others nothing (`held` is False there).
    """

    kind: Kind
    dim: int | None = None
    start: int = 0
    stop: int = 0
    owner: int | None = None
    held: bool = True

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The rank's tensor shape for a parameter of global `shape` (only meaningful when `held`)."""
        if self.kind != "split":
            return tuple(shape)
        assert self.dim is not None
        return tuple(self.stop - self.start if d == self.dim else n for d, n in enumerate(shape))


_ROW, _COL = 0, 1
# (pattern, rule): "rep" replicated, "row"/"col" split along dim 0/1 evenly, "rows_ceil" dim 0 in ceil chunks,
# "expert_row"/"expert_col" a routed expert's slice (tensor parallel) or its owner's (expert parallel),
# "shared_row"/"shared_col" the shared expert's slice (tensor parallel) or rank 0's whole (expert parallel)
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"embed\.weight", "row"),
    (r"head\.weight", "row"),
    (r"norm\.weight", "rep"),
    (r"layers\.\d+\.(attn_norm|ffn_norm)\.weight", "rep"),
    (r"layers\.\d+\.hc_(attn|ffn)_(fn|base|scale)", "rep"),
    (r"layers\.\d+\.attn\.(wq_a|wkv)\.weight", "rep"),
    (r"layers\.\d+\.attn\.(q_norm|kv_norm)\.weight", "rep"),
    (r"layers\.\d+\.attn\.wq_b\.weight", "row"),
    (r"layers\.\d+\.attn\.attn_sink", "row"),
    (r"layers\.\d+\.attn\.wo_a\.weight", "row"),
    (r"layers\.\d+\.attn\.wo_b\.weight", "col"),
    (r"layers\.\d+\.attn\.compressor\.(wkv|wgate|norm)\.weight", "rep"),
    (r"layers\.\d+\.attn\.indexer\.(wq_b|weights_proj)\.weight", "row"),
    (r"layers\.\d+\.attn\.indexer\.(wk|k_norm)\.weight", "rep"),
    (r"layers\.\d+\.ffn\.gate\.(weight|bias|bias_vl)", "rep"),
    (r"layers\.\d+\.ffn\.shared_experts\.(w1|w3)\.weight", "shared_row"),
    (r"layers\.\d+\.ffn\.shared_experts\.w2\.weight", "shared_col"),
    (r"layers\.\d+\.ffn\.experts\.\d+\.(w1|w3)\.weight", "expert_row"),
    (r"layers\.\d+\.ffn\.experts\.\d+\.w2\.weight", "expert_col"),
    (r"layers\.\d+\.engram\.embed\.weight", "rows_ceil"),
    (r"layers\.\d+\.engram\.(wkv\.weight|q_weight|k_weight)", "rep"),
))
_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's place in a tensor-parallel group of `world` ranks (vLLM's tensor_parallel_size), with routed experts
    sliced (expert_parallel False) or placed whole (True, vLLM's enable_expert_parallel)."""

    world: int
    rank: int
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ParallelLayoutError(f"world={self.world} must be at least 1")
        if not 0 <= self.rank < self.world:
            raise ParallelLayoutError(f"rank={self.rank} must lie in 0..{self.world - 1}")

    # ------------------------------------------------------------------ validation
    def problems(self, cfg: "CEDConfig") -> list[str]:
        """Every reason `cfg` cannot be split `world` ways, each naming its config key."""
        N, out = self.world, []

        def need(key: str, value: int, why: str) -> None:
            if value % N:
                out.append(f"{key}={value} is not divisible by the tensor parallel size {N} ({why})")

        need("vocab_size", cfg.vocab_size, "embedding and head rows are split by token id")
        need("n_heads", cfg.n_heads, "query heads are split")
        need("o_groups", cfg.o_groups, "the grouped output projection wo_a is split by group")
        need("index_n_heads", cfg.index_n_heads, "the indexer's query heads are split")
        if self.expert_parallel:
            need("n_routed_experts", cfg.n_routed_experts, "expert parallel places whole experts, E/N per rank")
        else:
            need("moe_inter_dim * n_shared_experts", cfg.moe_inter_dim * cfg.n_shared_experts,
                 "the shared expert is sliced along its intermediate dim")
            need("moe_inter_dim", cfg.moe_inter_dim, "routed experts are sliced along their intermediate dim")
        if cfg.runtime_fake_quant and not out:
            k_slices = {"o_groups * o_lora_rank / N (wo_b input)": cfg.o_groups * cfg.o_lora_rank // N}
            if not self.expert_parallel:
                k_slices["moe_inter_dim * n_shared_experts / N (shared w2 input)"] = (
                    cfg.moe_inter_dim * cfg.n_shared_experts // N)
                k_slices["moe_inter_dim / N (routed w2 input)"] = cfg.moe_inter_dim // N
            for key, k in k_slices.items():
                if k % ACT_QUANT_BLOCK:
                    out.append(f"{key}={k} is not a multiple of {ACT_QUANT_BLOCK}: runtime_fake_quant quantizes GEMM "
                               f"inputs per {ACT_QUANT_BLOCK} values, a block may not straddle two ranks")
        return out

    def check(self, cfg: "CEDConfig") -> None:
        problems = self.problems(cfg)
        if problems:
            mode = "tensor+expert" if self.expert_parallel else "tensor"
            raise ParallelLayoutError(f"config {cfg.name!r} cannot run {mode} parallel on {self.world} ranks: "
                                      + "; ".join(problems))

    # ------------------------------------------------------------------ placement
    def even_range(self, size: int) -> tuple[int, int]:
        """This rank's [start, stop) of an axis of `size` split in equal parts (the caller checked divisibility)."""
        part = size // self.world
        return self.rank * part, (self.rank + 1) * part

    def ceil_range(self, size: int) -> tuple[int, int]:
        """This rank's [start, stop) of an axis split in ceil(size / N) chunks (the last ranks may hold fewer)."""
        part = -(-size // self.world)
        start = min(self.rank * part, size)
        return start, min(start + part, size)

    def expert_owner(self, cfg: "CEDConfig", expert: int) -> int:
        """The rank holding routed expert `expert` under expert parallelism: contiguous blocks of E/N."""
        return expert // (cfg.n_routed_experts // self.world)

    def owned_experts(self, cfg: "CEDConfig") -> range:
        """The routed experts this rank computes: all (sliced) without expert parallelism, its block with it."""
        if not self.expert_parallel:
            return range(cfg.n_routed_experts)
        part = cfg.n_routed_experts // self.world
        return range(self.rank * part, (self.rank + 1) * part)

    def shard(self, cfg: "CEDConfig", name: str, shape: tuple[int, ...]) -> Shard:
        """The distribution of parameter `name` (global `shape`) as this rank sees it."""
        rule = next((r for p, r in _RULES if p.fullmatch(name)), None)
        if rule is None:
            raise ParallelLayoutError(f"no parallel rule for tensor {name!r}: add one to _RULES in "
                                      "ced/parallel/layout.py")
        if rule == "rep" or self.world == 1:
            return Shard("replicated")
        if rule in ("expert_row", "expert_col", "shared_row", "shared_col") and self.expert_parallel:
            match = _EXPERT.match(name)
            owner = SHARED_EXPERT_OWNER if match is None else self.expert_owner(cfg, int(match.group(1)))
            return Shard("owned", owner=owner, held=owner == self.rank)
        dim = _COL if rule in ("col", "expert_col", "shared_col") else _ROW
        start, stop = (self.ceil_range if rule == "rows_ceil" else self.even_range)(shape[dim])
        return Shard("split", dim=dim, start=start, stop=stop)


def sharding_plan(cfg: "CEDConfig", layout: ParallelLayout) -> dict[str, tuple[Shard, tuple[int, ...]]]:
    """Every parameter of `CEDNetwork(cfg)` -> (this rank's shard, global shape). Builds the network on the meta
    device (no memory) to read the names, so the plan can never miss a parameter the network has."""
    import torch

    from ced.model.network import CEDNetwork

    layout.check(cfg)
    with torch.device("meta"):
        net = CEDNetwork(cfg)
    return {name: (layout.shard(cfg, name, tuple(t.shape)), tuple(t.shape)) for name, t in net.state_dict().items()}


def held_numel(plan: dict[str, tuple[Shard, tuple[int, ...]]]) -> tuple[int, int]:
    """(elements this rank holds of replicated tensors, elements it holds of split or owned ones)."""
    replicated = sharded = 0
    for shard, shape in plan.values():
        if not shard.held:
            continue
        n = 1
        for d in shard.local_shape(shape):
            n *= d
        if shard.kind == "replicated":
            replicated += n
        else:
            sharded += n
    return replicated, sharded
