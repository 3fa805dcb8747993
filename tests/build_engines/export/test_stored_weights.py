"""Weights kept as stored (fp8 codes, packed fp4, e8m0 scales, bf16) and dequantized inside the step: the bounded
build's modules must compute what the fp32 modules compute, read only the role's tensors, and export with the stored
bytes (not fp32 copies) as the graph's weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from build_engines.build.onnx_build import ort_runner, random_bank
from build_engines.export.onnx_export import data_file, export_module
from build_engines.export.stored_role import load_stored_role, stores_quantized
from ced.formats.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    write_synthetic_release,
)
from ced.model.network import DecoderEngine, EncoderEngine
from ced.model.primitives import quantizes_input
from ced.model.quant_formats import (
    dequantize_fp4_packed,
    dequantize_fp8_blocks,
    quantize_fp4_packed,
    quantize_fp8_blocks,
)
from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.graph_ops import DenseExperts
from ced.steps.layout import GraphTensor, StepLayout
from ced.steps.parity import decoder_case, encoder_case, max_difference, torch_runner
from ced.steps.stored_weights import (
    StoredExperts,
    StoredLinear,
    StoredMatrix,
    StoredStack,
    StoredWeightError,
    experts_per_chunk,
    head_logits,
)
from tests.tiny import tiny_config, tiny_network


def _fp8(shape: tuple[int, int], seed: int, block: tuple[int, int] = (32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    return quantize_fp8_blocks(w, block=block)


def _fp4(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp4_packed(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("shape", [(64, 96), (40, 72), (32, 32)])
def test_fp8_weights_rebuild_the_loaders_values_bit_for_bit(shape: tuple[int, int]) -> None:
    q, scale = _fp8(shape, seed=sum(shape))
    m = StoredMatrix.from_stored("w", q, scale, shape)
    assert m.codes.dtype == torch.uint8 and m.scale.dtype == torch.uint8
    want = dequantize_fp8_blocks(q, scale)
    assert torch.equal(m.value().view(torch.int32), want.view(torch.int32))  # bits, signed zeros included


def test_packed_fp4_weights_rebuild_the_loaders_values_bit_for_bit() -> None:
    q, scale = _fp4((48, 128), seed=1)
    m = StoredMatrix.from_stored("w", q, scale, (48, 128))
    assert m.codes.numel() == 48 * 64
    assert torch.equal(m.value().view(torch.int32), dequantize_fp4_packed(q, scale).view(torch.int32))


def test_float_weights_keep_their_dtype_and_values() -> None:
    w = torch.randn(8, 16).to(torch.bfloat16)
    m = StoredMatrix.from_stored("w", w, None, (8, 16))
    assert m.codes.dtype == torch.bfloat16 and torch.equal(m.value(), w.float())


def test_joined_weights_equal_the_joined_values_and_misaligned_joins_are_refused() -> None:
    parts = [StoredMatrix.from_stored(f"e{i}", *_fp4((32, 64), seed=i), (32, 64)) for i in range(3)]
    rows = StoredMatrix.concatenated("rows", parts, 0)
    cols = StoredMatrix.concatenated("cols", parts, 1)
    assert torch.equal(rows.value(), torch.cat([p.value() for p in parts], 0))
    assert torch.equal(cols.value(), torch.cat([p.value() for p in parts], 1))
    odd = StoredMatrix.from_stored("odd", *_fp8((40, 64), seed=5), (40, 64))
    with pytest.raises(StoredWeightError, match="scale block"):
        StoredMatrix.concatenated("bad", [odd, odd], 0)
    with pytest.raises(StoredWeightError, match="stored differently"):
        StoredMatrix.concatenated("mixed",
                                  [parts[0], StoredMatrix.from_stored("f", torch.zeros(32, 64), None, (32, 64))], 0)


def test_a_stored_fp4_tensor_with_the_wrong_scale_is_refused_by_name() -> None:
    q, scale = _fp4((32, 64), seed=2)
    with pytest.raises(StoredWeightError, match="experts.3.w1.weight"):
        StoredMatrix.from_stored("experts.3.w1.weight", q, scale[:, :1], (32, 64))


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = StoredLinear(StoredMatrix.from_stored("a", *_fp8((64, 64), seed=3), (64, 64)), quantize_input=True)
        self.b = StoredLinear(StoredMatrix.from_stored("b", *_fp4((32, 64), seed=4), (32, 64)), quantize_input=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@torch.no_grad()
def test_the_graph_keeps_the_stored_bytes_in_a_data_file_and_computes_the_module(tmp_path: Path) -> None:
    module = _TwoLinears().eval()
    path = tmp_path / "two.onnx"
    model = export_module(module, [GraphTensor("x", "float32", ("B", 64))], [GraphTensor("y", "float32", ("B", 32))],
                          {"B": 3}, path, external_data=True)
    kinds = {onnx.TensorProto.DataType.Name(t.data_type) for t in model.graph.initializer
             if t.dims and np.prod(t.dims) >= 1024}
    assert kinds == {"UINT8"}, kinds  # codes and scales as stored: no fp32 copy of a weight was folded in
    assert data_file(path).exists()
    assert not any(t.HasField("raw_data") and len(t.raw_data) >= 1024 for t in model.graph.initializer)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    want = module(torch.from_numpy(x)).numpy()
    got = ort_runner(path, fold_constants=False)({"x": x})["y"]
    assert np.abs(got - want).max() < 1e-5


def test_stored_experts_chunk_within_their_byte_budget_and_multiply_as_the_dense_experts(tmp_path: Path) -> None:
    cfg = tiny_config(runtime_fake_quant=False)
    path = write_synthetic_release(cfg, tmp_path / "release", seed=4, extras=False)
    _, component = load_stored_role(path, "decoder")
    reference = load_checkpoint(path, role="decoder")
    layer = str(cfg.first_decoder_layer + 1)
    per_expert = 4 * 3 * cfg.dim * cfg.moe_inter_dim
    stored = StoredExperts(component.layers[layer].ffn, chunk_bytes=3 * per_expert)
    dense = DenseExperts(reference.layers[layer].ffn)
    assert cfg.n_routed_experts == 4 and stored.per_chunk == 2 and stored.chunk_count == 2  # 3 fit, 2 divide 4
    assert tuple(stored.routed_up.codes.shape[:2]) == (2, 2 * 2 * cfg.moe_inter_dim)
    x = torch.randn(2, 5, cfg.dim, generator=torch.Generator().manual_seed(0))
    act = torch.randn(2, 5, dense.count * dense.inter, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((stored.up(x) - x @ dense.w13).abs().max()) < 1e-6
        assert float((stored.down(act) - act @ dense.w2).abs().max()) < 1e-5


def test_experts_per_chunk_fill_the_budget_with_a_divisor_of_the_routed_count() -> None:
    assert experts_per_chunk(256, 100 << 20, 16 << 20) == 1  # a full-size expert is past the budget alone
    assert experts_per_chunk(256, 1 << 20, 16 << 20) == 16
    assert experts_per_chunk(256, 1 << 20, 12 << 20) == 8
    assert experts_per_chunk(48, 1 << 20, 1 << 30) == 48
    assert experts_per_chunk(7, 1 << 20, 6 << 20) == 1  # a prime count: one expert per chunk


class _StackedExperts(nn.Module):
    """One MoE's stored experts as a graph: the up-projection of x and the down-projection of a."""

    def __init__(self, experts: StoredExperts) -> None:
        super().__init__()
        self.experts, self.weights = experts, nn.ModuleList(experts.chunks())

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts.up(x), self.experts.down(a)


@torch.no_grad()
def test_a_layers_routed_experts_export_as_one_scan_whatever_their_count(tmp_path: Path) -> None:
    """At one expert per chunk (what the release's 100 MB experts give), the graph walks the routed experts with one
    Scan per projection: 4 and 12 experts give the same nodes (when each chunk was its own weight, 154 and 386), the
    stored bytes stay uint8 initializers, and onnxruntime computes the module's products: the up-projection bit for
    bit (the same per-chunk GEMMs), the down-projection to float accuracy."""
    nodes = {}
    for routed in (4, 12):
        cfg = tiny_config(runtime_fake_quant=True, n_routed_experts=routed)
        path = write_synthetic_release(cfg, tmp_path / f"release{routed}", seed=8, extras=False)
        _, component = load_stored_role(path, "decoder")
        experts = StoredExperts(component.layers[str(cfg.first_decoder_layer + 1)].ffn, chunk_bytes=1)
        assert experts.per_chunk == 1 and experts.chunk_count == routed
        width = experts.count * experts.inter
        graph = tmp_path / f"experts{routed}.onnx"
        model = export_module(_StackedExperts(experts).eval(),
                              [GraphTensor("x", "float32", ("B", "S", cfg.dim)),
                               GraphTensor("a", "float32", ("B", "S", width))],
                              [GraphTensor("up", "float32", ("B", "S", 2 * width)),
                               GraphTensor("down", "float32", ("B", "S", cfg.dim))],
                              {"B": 2, "S": 3}, graph, external_data=True)
        nodes[routed] = [n.op_type for n in model.graph.node]
        assert nodes[routed].count("Scan") == 2
        large = [t for t in model.graph.initializer if t.dims and np.prod(t.dims) >= 1024]
        assert {onnx.TensorProto.DataType.Name(t.data_type) for t in large} == {"UINT8"}
        rng = np.random.default_rng(1)
        x = rng.standard_normal((3, 5, cfg.dim)).astype(np.float32)
        a = rng.standard_normal((3, 5, width)).astype(np.float32)
        got = ort_runner(graph, fold_constants=False)({"x": x, "a": a})
        up, down = _StackedExperts(experts)(torch.from_numpy(x), torch.from_numpy(a))
        assert np.array_equal(got["up"], up.numpy())
        assert np.abs(got["down"] - down.numpy()).max() < 1e-5
    assert nodes[4] == nodes[12], (len(nodes[4]), len(nodes[12]))


def test_a_stack_refuses_weights_stored_differently() -> None:
    same = StoredMatrix.from_stored("a", *_fp8((64, 64), seed=1), (64, 64))
    other = StoredMatrix.from_stored("b", *_fp8((32, 64), seed=2), (32, 64))
    with pytest.raises(StoredWeightError, match=r"weight 1 of the stack is stored as fp8 \(32, 64\)"):
        StoredStack("w", [[same], [other]], 0)


class _BfloatHead(nn.Module):
    def __init__(self, weight: torch.Tensor, chunk_bytes: int) -> None:
        super().__init__()
        self.weight, self.chunk_bytes = nn.Parameter(weight, requires_grad=False), chunk_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_logits(x, self.weight, self.chunk_bytes)


def test_a_bfloat16_head_is_cast_in_chunks_of_rows_and_gives_the_whole_products(tmp_path: Path) -> None:
    """The release's bf16 head cast to fp32 whole is twice its stored bytes at once; in chunks of vocabulary rows each
    cast lives only while it multiplies. The logits are those of the whole cast (module and graph), an fp32 head is
    used as it is, and the graph keeps the head as bf16 (no fp32 copy folded in)."""
    vocab, dim = 1000, 64
    weight = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(3))
    whole = x @ weight.float().t()
    budget = 4 * dim * 96  # 96 rows a chunk: 10 full chunks and one of 40 rows
    assert torch.equal(head_logits(x, weight, budget), whole)
    fp32 = weight.float()
    assert torch.equal(head_logits(x, fp32, budget), x @ fp32.t())
    path = tmp_path / "head.onnx"
    model = export_module(_BfloatHead(weight, budget).eval(), [GraphTensor("x", "float32", ("B", dim))],
                          [GraphTensor("y", "float32", ("B", vocab))], {"B": 3}, path, external_data=True)
    large = [t for t in model.graph.initializer if t.dims and np.prod(t.dims) >= 1024]
    assert {onnx.TensorProto.DataType.Name(t.data_type) for t in large} == {"BFLOAT16"}
    assert sum(1 for n in model.graph.node if n.op_type == "MatMul") == 11
    got = ort_runner(path, fold_constants=False)({"x": x.numpy()})["y"]
    assert np.abs(got - whole.numpy()).max() < 1e-5


def test_the_chunk_budget_comes_from_the_build_and_a_bad_one_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--expert-chunk-bytes` reaches the spawned build workers through `MOL2_EXPERT_CHUNK_BYTES`: 1 byte means one
    expert per chunk (what the release's 100 MB experts give at the default), a value that is not a positive number
    of bytes is refused by name, and the CLI refuses it before building anything."""
    from build_engines.build.cli import main as build_main
    from ced.steps.stored_weights import (
        EXPERT_CHUNK_BYTES,
        EXPERT_CHUNK_ENV,
        expert_chunk_bytes,
        experts_for,
    )

    cfg = tiny_config(runtime_fake_quant=False)
    path = write_synthetic_release(cfg, tmp_path / "release", seed=5, extras=False)
    _, component = load_stored_role(path, "decoder")
    moe = component.layers[str(cfg.first_decoder_layer + 1)].ffn
    monkeypatch.delenv(EXPERT_CHUNK_ENV, raising=False)
    assert expert_chunk_bytes() == EXPERT_CHUNK_BYTES
    monkeypatch.setenv(EXPERT_CHUNK_ENV, "1")
    experts = experts_for(moe)
    assert isinstance(experts, StoredExperts) and experts.per_chunk == 1 and experts.chunk_count == cfg.n_routed_experts
    monkeypatch.setenv(EXPERT_CHUNK_ENV, "-4")
    with pytest.raises(StoredWeightError, match=r"MOL2_EXPERT_CHUNK_BYTES='-4': expected a positive number of bytes"):
        expert_chunk_bytes()
    assert build_main(["--model", str(path), "--out", str(tmp_path / "engines"), "--expert-chunk-bytes", "0"]) == 2
    assert not (tmp_path / "engines").exists()


def test_only_a_checkpoint_with_fp8_or_fp4_weights_takes_the_stored_build(tmp_path: Path) -> None:
    release = write_synthetic_release(tiny_config(), tmp_path / "release", seed=6, extras=False)
    ours = save_checkpoint(tiny_network(), tmp_path / "ours")
    assert stores_quantized(release) and not stores_quantized(ours)


@torch.no_grad()
def test_stored_steps_compute_what_the_fp32_steps_compute(tmp_path: Path) -> None:
    """Without the runtime fake-quant (whose rounding ties turn ulps into steps), a step on stored weights follows the
    fp32 step to float accuracy: same weights bit for bit, only the MoE's down-projection summed by chunk."""
    cfg = tiny_config(runtime_fake_quant=False)
    path = write_synthetic_release(cfg, tmp_path / "release", seed=7, extras=False)
    layout = StepLayout(cfg)
    state = load_checkpoint(path).state_dict()
    steps = {"stored": (EncoderStep(load_stored_role(path, "encoder")[1]).eval(),
                        DecoderStep(load_stored_role(path, "decoder")[1]).eval()),
             "fp32": (EncoderStep(EncoderEngine.from_state_dict(cfg, state).eval()).eval(),
                      DecoderStep(DecoderEngine.from_state_dict(cfg, state).eval()).eval())}
    enc = {k: torch_runner(e, layout.encoder_inputs(), layout.encoder_outputs()) for k, (e, _) in steps.items()}
    dec = {k: torch_runner(d, layout.decoder_inputs(), layout.decoder_outputs()) for k, (_, d) in steps.items()}
    case = encoder_case(layout, enc["fp32"], (37, 6), seed=0)
    assert max(max_difference(enc["fp32"](case), enc["stored"](case)).values()) < 1e-5
    feed = {**decoder_case(layout, enc["fp32"], 30, seed=1, slots=[1, 2]), **random_bank(layout, slots=3, rank=4)}
    assert max(max_difference(dec["fp32"](feed), dec["stored"](feed)).values()) < 1e-5


def test_stored_projections_keep_the_releases_activation_quantization(tmp_path: Path) -> None:
    """Every projection the reference quantizes the input of (fp8, per 32, under the runtime fake-quant) is quantized
    the same way when its weight stays stored, and none other."""
    cfg = tiny_config(runtime_fake_quant=True)
    path = write_synthetic_release(cfg, tmp_path / "release", seed=8, extras=False)
    for role in ("encoder", "decoder"):
        _, stored = load_stored_role(path, role)
        reference = load_checkpoint(path, role=role)
        flags = {name: quantizes_input(m) for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
        assert any(flags.values()) and not all(flags.values())
        for name, flag in flags.items():
            assert quantizes_input(stored.get_submodule(name)) == flag, name


class ManySplits(nn.Module):
    """Splits its input into 60 parts (as the up-projection splits into one part per expert chunk: 49 with 48
    experts at one expert per chunk), so the graph carries a 60-entry int64 `split` initializer (480 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(60, 60))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x @ self.weight, [1] * 60, -1)
        return sum(p * (i + 1) for i, p in enumerate(parts))


def test_shape_constants_stay_in_the_graph_when_the_weights_go_to_a_data_file(tmp_path: Path) -> None:
    """onnxruntime's shape inference cannot read a Split's sizes (or any shape input) from external data: a release
    build with 48 experts failed to load ("Cannot parse data from external tensors") once the sizes passed the
    writer's default 256-byte threshold. Small tensors stay inline; the weight still goes to the data file."""
    path = tmp_path / "splits.onnx"
    module = ManySplits().eval()
    export_module(module, [GraphTensor("x", "float32", ("n", 60))], [GraphTensor("y", "float32", ("n", 1))], {"n": 3},
                  path, external_data=True)
    model = onnx.load(str(path), load_external_data=False)
    external = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external and all(t.data_type != onnx.TensorProto.INT64 for t in model.graph.initializer
                            if t.name in external)
    x = np.random.default_rng(0).standard_normal((4, 60)).astype(np.float32)
    got = ort_runner(path)({"x": x})["y"]
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    assert np.abs(got - want).max() < 1e-3
