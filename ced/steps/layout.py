"""The contract of the step graphs: every input and output of the encoder, decoder and pointer graphs, as data.

Names, dtypes and shapes are written once here; the step modules take and return tensors in this order, the ONNX
export names the graph's inputs and outputs from it, the manifest records it, and the runtimes feed by it.
Symbolic dimensions: B rows, S positions per row (a turn, one token, or W replayed rows), N_<layer> entries of a
global-KV store (padded: the runtime keeps N >= used entries + the step's new ones, N a multiple of the candidate
block and >= the top-k sizes), M_<layer> new entries of a ratio-2 store ((S + 1) // 2), R the LoRA rank, A the
adapter slots (slot 0 = the base model: all zeros), K the positions a decoder step also returns logits for (a
speculative block's, `verify`; 0 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from ced.model.config import CEDConfig
from ced.model.dspark_spec import DSparkSpec

SPEC_BLOCK = 8  # the longest speculative block a decode step verifies (DSpark's is 5: the last token and 4 drafts)


@dataclass(frozen=True)
class GraphTensor:
    name: str
    dtype: str  # "float32" | "int64" | "bool"
    dims: tuple[int | str, ...]
    doc: str = ""

    def shape_for(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)


@dataclass(frozen=True)
class LoraGroup:
    """One LoRA input pair of the decoder graph: `lora_a.<name>` and `lora_b.<name>`.

    kind "linear": one Linear `module`; A (A, in, R), B (A, R, out), B pre-scaled by alpha / r.
    kind "experts_w13": the up-projections of every expert of a MoE (routed then shared; w1, w3 each):
        A (A, dim, G*2, R), B (A, G*2, R, inter).
    kind "experts_w2": the down-projections: A (A, G, inter, R), B (A, G, R, dim).
    """

    name: str
    kind: str
    modules: tuple[str, ...]  # the PEFT module names this group carries, in its own order
    in_features: int
    out_features: int


def _linear(name: str, module: str, in_f: int, out_f: int) -> LoraGroup:
    return LoraGroup(name, "linear", (module,), in_f, out_f)


class StepLayout:
    """Everything shape-related that the step modules, the export, the runtimes and the LoRA stacking share."""

    def __init__(self, cfg: CEDConfig, drafter: DSparkSpec | None = None) -> None:
        """`drafter`: the DSpark drafter the engines were built with (the decoder then returns `draft_main`, and a
        drafter graph exists); None for engines without one."""
        self.cfg, self.drafter = cfg, drafter
        E = cfg.first_decoder_layer
        self.encoder_ring_layers = tuple(range(E + 1))
        self.decoder_ring_layers = tuple(range(E + 1, cfg.n_layers))
        self.sources = tuple(cfg.kv_source_layers)  # every KV source sits in the encoder (layer E included)
        self.ratio = {s: cfg.compress_ratios[s] for s in self.sources}
        missing_keys = [s for s in self.sources if not cfg.owns_index_keys(s)]
        if missing_keys:
            raise ValueError(f"every KV source must own index keys for the engine layout, not {missing_keys}")
        self.experts = cfg.n_routed_experts + 1
        if cfg.n_shared_experts != 1:
            raise ValueError("the engine layout computes the shared expert beside the routed ones and needs "
                             f"exactly one, got n_shared_experts={cfg.n_shared_experts}")
        self.min_global_entries = max(cfg.index_topk, cfg.candidate_topk_blocks * cfg.candidate_block_size, 1)
        self.engram_layers = tuple(cfg.engram_layers)  # encoder layers whose Engram rows the runtime feeds
        self.engram_cols = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads if cfg.engram_layers else 0
        self.engram_history = cfg.engram_max_ngram - 1 if cfg.engram_layers else 0  # token ids a row remembers

    # ------------------------------------------------------------------ padding rules for global stores
    def padded_entries(self, needed: int) -> int:
        """A store length >= needed: a power of two times the candidate block, at least the top-k sizes."""
        size = self.min_global_entries
        while size < needed:
            size *= 2
        return size

    def new_entries(self, source: int, steps: int) -> int:
        return steps if self.ratio[source] == 1 else (steps + 1) // 2

    # ------------------------------------------------------------------ encoder graph
    def encoder_inputs(self) -> list[GraphTensor]:
        cfg = self.cfg
        out = [
            GraphTensor("tokens", "int64", ("B", "S"), "token ids of this step"),
            GraphTensor("start", "int64", ("B",),
                        "position of each row's first token (rows' state is at this position)"),
            GraphTensor("rings", "float32", ("B", len(self.encoder_ring_layers), cfg.window_size, cfg.head_dim),
                        "window rings of layers 0..E (slot = position % W)"),
        ]
        for s in self.sources:
            n = f"N_{s}"
            out += [GraphTensor(f"kv_{s}", "float32", ("B", n, cfg.head_dim),
                                f"layer {s}'s global KV entries (post-RoPE)"),
                    GraphTensor(f"index_k_{s}", "float32", ("B", n, cfg.index_head_dim), f"layer {s}'s index keys")]
            if self.ratio[s] == 2:
                out.append(GraphTensor(f"pending_{s}", "float32", ("B", 2, cfg.head_dim),
                                       "raw kv and gate score of an unpaired token (used when start is odd)"))
        for l in self.engram_layers:
            out.append(GraphTensor(f"engram_rows_{l}", "float32", ("B", "S", self.engram_cols, cfg.engram_head_dim),
                                   f"layer {l}'s Engram table rows at each token's n-gram hashes "
                                   "(gathered on the host)"))
        return out

    def encoder_outputs(self) -> list[GraphTensor]:
        cfg = self.cfg
        out = [
            GraphTensor("h19", "float32", ("B", "S", cfg.dim),
                        "last encoder layer's streams, mean over hc (router input)"),
            GraphTensor("streams", "float32", ("B", "S", cfg.hc_mult, cfg.dim),
                        "hand-over: streams after layer E's attention"),
            GraphTensor("ffn_pre", "float32", ("B", "S", cfg.hc_mult), "hand-over: layer E's pre mix into its FFN"),
            GraphTensor("topk", "int64", ("B", "S", cfg.index_topk),
                        "hand-over: layer E's top-k entries (absolute, -1 none)"),
            GraphTensor("candidates", "int64", ("B", "S", cfg.candidate_topk_blocks),
                        "hand-over: layer E's candidate blocks"),
            GraphTensor("global_kv", "float32", ("B", "S", cfg.head_dim), "hand-over: layer E's new global entries"),
            GraphTensor("index_k", "float32", ("B", "S", cfg.index_head_dim), "hand-over: layer E's new index keys"),
            GraphTensor("ring_rows", "float32", ("B", len(self.encoder_ring_layers), "S", cfg.head_dim),
                        "this step's latents per ring layer (the runtime keeps the last W)"),
        ]
        for s in self.sources:
            if self.ratio[s] == 2:
                m = f"M_{s}"
                out += [GraphTensor(f"new_kv_{s}", "float32", ("B", m, cfg.head_dim),
                                    "new pooled entries ((start%2+S)//2 valid)"),
                        GraphTensor(f"new_index_k_{s}", "float32", ("B", m, cfg.index_head_dim), "their index keys"),
                        GraphTensor(f"pending_rows_{s}", "float32", ("B", "S", 2, cfg.head_dim),
                                    "each token's raw kv and gate score "
                                    "(the row keeps its last absorbed one as pending)")]
        return out

    # ------------------------------------------------------------------ decoder graph
    def lora_groups(self) -> list[LoraGroup]:
        cfg = self.cfg
        E, H, D = cfg.first_decoder_layer, cfg.n_heads, cfg.head_dim
        groups: list[LoraGroup] = []
        for l in range(E, cfg.n_layers):
            if l > E:
                a = f"layers.{l}.attn"
                groups += [_linear(f"{a}.wq_a", f"{a}.wq_a", cfg.dim, cfg.q_lora_rank),
                           _linear(f"{a}.wq_b", f"{a}.wq_b", cfg.q_lora_rank, H * D),
                           _linear(f"{a}.wkv", f"{a}.wkv", cfg.dim, D),
                           _linear(f"{a}.wo_b", f"{a}.wo_b", cfg.o_groups * cfg.o_lora_rank, cfg.dim)]
                if l in cfg.index_source_layers:
                    groups += [_linear(f"{a}.indexer.wq_b", f"{a}.indexer.wq_b", cfg.q_lora_rank,
                                       cfg.index_n_heads * cfg.index_head_dim),
                               _linear(f"{a}.indexer.weights_proj", f"{a}.indexer.weights_proj", cfg.dim,
                                       cfg.index_n_heads)]
            experts = ([f"layers.{l}.ffn.experts.{e}" for e in range(cfg.n_routed_experts)]
                       + [f"layers.{l}.ffn.shared_experts"])
            w13 = tuple(f"{e}.{w}" for e in experts for w in ("w1", "w3"))
            groups += [LoraGroup(f"layers.{l}.ffn.experts_w13", "experts_w13", w13, cfg.dim, cfg.moe_inter_dim),
                       LoraGroup(f"layers.{l}.ffn.experts_w2", "experts_w2", tuple(f"{e}.w2" for e in experts),
                                 cfg.moe_inter_dim, cfg.dim)]
        return groups

    def lora_shapes(self, group: LoraGroup, slots: int | str = "A", rank: int | str = "R") -> tuple[tuple, tuple]:
        G = self.experts
        if group.kind == "linear":
            return (slots, group.in_features, rank), (slots, rank, group.out_features)
        if group.kind == "experts_w13":
            return (slots, group.in_features, G * 2, rank), (slots, G * 2, rank, group.out_features)
        return (slots, G, group.in_features, rank), (slots, G, rank, group.out_features)

    def decoder_inputs(self) -> list[GraphTensor]:
        cfg = self.cfg
        E = cfg.first_decoder_layer
        out = [
            GraphTensor("streams", "float32", ("B", "S", cfg.hc_mult, cfg.dim), "hand-over rows"),
            GraphTensor("ffn_pre", "float32", ("B", "S", cfg.hc_mult), "hand-over rows"),
            GraphTensor("topk", "int64", ("B", "S", cfg.index_topk), "hand-over rows"),
            GraphTensor("candidates", "int64", ("B", "S", cfg.candidate_topk_blocks), "hand-over rows"),
            GraphTensor("start", "int64", ("B",), "position of each row's first hand-over row"),
            GraphTensor("ring_start", "int64", ("B",),
                        "first position the rings hold; a replay's first real row (rows before it are padding)"),
            GraphTensor("rings", "float32", ("B", len(self.decoder_ring_layers), cfg.window_size, cfg.head_dim),
                        "the active adapter's rings of layers E+1..L-1"),
            GraphTensor("kv", "float32", ("B", f"N_{E}", cfg.head_dim),
                        f"layer {E}'s global KV mirror, these rows included"),
            GraphTensor("index_k", "float32", ("B", f"N_{E}", cfg.index_head_dim),
                        f"layer {E}'s index keys, these rows included"),
            GraphTensor("lora_used", "int64", ("U",), "bank slots this step uses (0 = base), ascending"),
            GraphTensor("lora_rows", "int64", ("U", "C"),
                        "positions (b * S + s) on each used slot, padded by repeating one (C >= 2)"),
            GraphTensor("lora_at", "int64", ("B", "S"),
                        "each position's place in that grid: u * C + c (`lora_grid.py`)"),
            GraphTensor("verify", "int64", ("B", "K"), "in-step offsets whose logits `verify_logits` returns: a "
                        "speculative block's positions (K = 0 on other steps)"),
        ]
        for g in self.lora_groups():
            a, b = self.lora_shapes(g)
            out += [GraphTensor(f"lora_a.{g.name}", "float32", a, g.kind),
                    GraphTensor(f"lora_b.{g.name}", "float32", b, g.kind)]
        return out

    def decoder_outputs(self) -> list[GraphTensor]:
        cfg = self.cfg
        draft = [GraphTensor("draft_main", "float32", ("B", "S", cfg.dim),
                             "DSpark's main_x row of each position (stage 0's projection of the target layers' stream "
                             "means), for the draft ring")] if self.drafter else []
        return [
            GraphTensor("logits", "float32", ("B", cfg.vocab_size), "next-token logits after each row's last position"),
            GraphTensor("verify_logits", "float32", ("B", "K", cfg.vocab_size),
                        "next-token logits after each `verify` position"),
            GraphTensor("ring_rows", "float32", ("B", len(self.decoder_ring_layers), "S", cfg.head_dim),
                        "this step's latents per decoder ring layer"),
        ] + draft

    # ------------------------------------------------------------------ drafter graph (DSpark)
    def drafter_inputs(self) -> list[GraphTensor]:
        cfg = self.cfg
        return [
            GraphTensor("main_x", "float32", ("B", cfg.window_size, cfg.dim),
                        "each row's newest `draft_main` rows, oldest first (main_count valid, the rest padding)"),
            GraphTensor("main_count", "int64", ("B",), "valid rows of main_x (1..window)"),
            GraphTensor("last_position", "int64", ("B",), "position of each row's newest main_x row"),
            GraphTensor("last_token", "int64", ("B",), "the token sampled after that position (the block's first)"),
        ]

    def drafter_outputs(self) -> list[GraphTensor]:
        assert self.drafter is not None
        K = self.drafter.block_size
        return [GraphTensor("draft_tokens", "int64", ("B", K), "greedy drafts for the positions after last_token"),
                GraphTensor("draft_confidence", "float32", ("B", K), "the confidence head's raw score of each draft")]

    # ------------------------------------------------------------------ pointer graph
    def pointer_inputs(self, model_dim: int, width: int) -> list[GraphTensor]:
        return [
            GraphTensor("h19", "float32", ("B", model_dim), "H19 pooled over the user turn"),
            GraphTensor("attn_query", "float32", (width, "HL"), "option cache"),
            GraphTensor("attn_bias", "float32", ("HL",), "option cache"),
            GraphTensor("point_query", "float32", (width, "n"), "option cache"),
            GraphTensor("point_read", "float32", ("HL", "n"), "option cache"),
            GraphTensor("point_bias", "float32", ("n",), "option cache"),
            GraphTensor("option_mask", "bool", ("B", "n"), "candidate options per row"),
        ]

    @staticmethod
    def pointer_outputs() -> list[GraphTensor]:
        return [GraphTensor("logits", "float32", ("B", "n"), "one logit per option, -inf outside the candidates")]


def layout_markdown(layout: StepLayout, router_width: int) -> str:
    """The graphs' inputs and outputs as markdown tables (pasted into docs/engines.md; a test keeps them in sync)."""
    out = []
    bank = ("lora_a.", "lora_b.")
    groups = layout.lora_groups()
    sections = [("encoder", layout.encoder_inputs(), layout.encoder_outputs()),
                ("decoder", [t for t in layout.decoder_inputs() if not t.name.startswith(bank)],
                 layout.decoder_outputs()),
                ("pointer", layout.pointer_inputs(layout.cfg.dim, router_width), layout.pointer_outputs())]
    if layout.drafter is not None:
        sections.append(("drafter", layout.drafter_inputs(), layout.drafter_outputs()))
    for name, inputs, outputs in sections:
        out += [f"### {name}.onnx", "", "| direction | name | dtype | dims | meaning |", "|---|---|---|---|---|"]
        for t in inputs:
            out.append(f"| in | `{t.name}` | {t.dtype} | {list(t.dims)} | {t.doc} |")
        if name == "decoder":
            kinds = ", ".join(sorted({g.kind for g in groups}))
            out.append(f"| in | `lora_a.<group>`, `lora_b.<group>` | float32 | below | the adapter bank: "
                       f"{len(groups)} groups ({kinds}) |")
        for t in outputs:
            out.append(f"| out | `{t.name}` | {t.dtype} | {list(t.dims)} | {t.doc} |")
        if name == "decoder":
            out += ["", "LoRA groups (A = adapter slots, R = rank, slot 0 = base):", "",
                    "| group | kind | lora_a dims | lora_b dims |",
                    "|---|---|---|---|"]
            for g in groups:
                a, b = layout.lora_shapes(g)
                out.append(f"| `{g.name}` | {g.kind} | {list(a)} | {list(b)} |")
        out.append("")
    return "\n".join(out)
