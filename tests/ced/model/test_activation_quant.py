"""fp8 activation quantization at the GEMM inputs of the reference network, as V4.1's `linear()` does.

Under `runtime_fake_quant` exactly the GEMMs against the release's fp8/fp4 weights read `fp8_qdq(x, 32)`: attention
wq_a, wq_b, wkv, wo_b, indexer wq_b, w1/w2/w3 of every routed and shared expert (and Engram's wkv where a config has
it). The bf16/fp32 ones (MoE gate, compressor wkv/wgate, indexer weights_proj and wk, the grouped wo_a einsum, the
head) read x unquantized. Switched off, the network computes what it computed before the switch existed, bit for bit.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ced.model.moe import Expert
from ced.model.network import CEDNetwork
from ced.model.primitives import ACT_QUANT_BLOCK, ActQuantLinear, gemm_input, quantizes_input
from ced.model.quant_formats import fp8_qdq
from tests.tiny import tiny_config, tiny_network

QUANTIZED = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.(experts\.\d+|shared_experts)\.(w1|w2|w3)"
                       r"|engram\.wkv)\.weight$")
UNQUANTIZED = re.compile(r"(\.ffn\.gate|\.attn\.compressor\.(wkv|wgate)|\.attn\.indexer\.(weights_proj|wk)"
                         r"|\.attn\.wo_a)\.weight$"
                         r"|^head\.weight$")
LENGTH = 40  # 20 ratio-2 entries, 40 ratio-1 entries: every compressor, indexer and candidate pool runs

_GEMMS = {F.linear, torch.einsum, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zero (torch.equal calls -0.0 and 0.0 equal)."""
    return a.shape == b.shape and a.dtype == b.dtype == torch.float32 and torch.equal(_bits(a), _bits(b))


class GemmOperands(TorchFunctionMode):
    """Records, for every weight matrix of a Linear (and the MoE gate's), the other operand of each GEMM it enters.

    Weights are recognised by storage, so views (wo_a's grouped `.view(...)` in the einsum) and `.float()` of an fp32
    weight (the gate, the head) count as the weight. This sees what the GEMM really reads, which a forward hook on
    the module does not: an `ActQuantLinear` quantizes inside its forward, after the hook's input.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()
                      if n.endswith("weight") and p.dim() == 2 and not n.startswith("embed")}
        self.seen: dict[str, list[torch.Tensor]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _GEMMS:
            operands = [a for a in (args[1:] if func is torch.einsum else args) if isinstance(a, torch.Tensor)]
            for i, t in enumerate(operands):
                name = self.names.get(t.untyped_storage().data_ptr()) if t.numel() else None
                if name is not None and len(operands) == 2:
                    self.seen[name].append(operands[1 - i].detach().clone())
        return func(*args, **kwargs)


def _run_recorded(net: CEDNetwork, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    recorder = GemmOperands(net)
    with torch.no_grad(), recorder:
        logits = net(tokens).logits
    return logits, recorder.seen


def _quant_net(quant: bool) -> CEDNetwork:
    return tiny_network(tiny_config(runtime_fake_quant=quant))


def test_exactly_the_release_fp8_and_fp4_weights_read_quantized_inputs(seed: int) -> None:
    net = _quant_net(True)
    weights = [n for n, p in net.named_parameters() if QUANTIZED.search(n) or UNQUANTIZED.search(n)]
    assert {n for n in weights if UNQUANTIZED.search(n)} and {n for n in weights if QUANTIZED.search(n)}
    # the property needs every routed expert to be chosen at least once; random tokens over 2 rows miss one about
    # once in 60 draws, so more rows are drawn until each expert has run (the routing itself is not under test)
    for rows in (2, 8, 32):
        _, seen = _run_recorded(net, torch.randint(0, net.cfg.vocab_size, (rows, LENGTH)))
        if set(seen) >= set(weights):
            break
    assert sorted(seen) == sorted(weights), (
        "every projection of interest ran (each expert was chosen), and nothing else")
    for name, operands in seen.items():
        for x in operands:
            q = fp8_qdq(x, ACT_QUANT_BLOCK)
            assert _bitwise_equal(fp8_qdq(q, ACT_QUANT_BLOCK), q), "fp8_qdq is idempotent"
            if QUANTIZED.search(name):
                assert _bitwise_equal(x, q), f"{name}: its GEMM input is not fp8_qdq'd"
            else:
                assert not torch.equal(x, q), (
                    f"{name}: its GEMM input is quantized (or quantization would not change it)")
    # the modules' own inputs (what LoRA hooks read) stay unquantized: the LoRA product never sees the fp8 activation
    quantized = {n: m for n, m in net.named_modules() if quantizes_input(m)}
    assert sorted(f"{n}.weight" for n in quantized) == sorted(n for n in weights if QUANTIZED.search(n))
    calls: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda m, i, o: calls.append((m, i[0], o))) for m in quantized.values()]
    with torch.no_grad():
        net(torch.randint(0, net.cfg.vocab_size, (1, LENGTH)))
    for h in handles:
        h.remove()
    assert calls
    for module, x, y in calls:
        assert not torch.equal(x, fp8_qdq(x, ACT_QUANT_BLOCK)), "a hook sees the unquantized input"
        assert _bitwise_equal(y, F.linear(fp8_qdq(x, ACT_QUANT_BLOCK), module.weight))


def _legacy_copy(net: CEDNetwork) -> CEDNetwork:
    """The network as it was before the switch: every ActQuantLinear replaced by a plain nn.Linear on the same
    weight."""
    old = copy.deepcopy(net)
    for module in list(old.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, ActQuantLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=False)
                plain.weight = child.weight
                setattr(module, child_name, plain)
    assert not any(isinstance(m, ActQuantLinear) for m in old.modules())
    return old


def test_switched_off_the_network_is_bit_identical_to_the_unquantized_one(seed: int) -> None:
    net = _quant_net(False)
    tokens = torch.randint(0, net.cfg.vocab_size, (2, LENGTH))
    logits, seen = _run_recorded(net, tokens)
    for name, operands in seen.items():
        assert all(not torch.equal(x, fp8_qdq(x, ACT_QUANT_BLOCK)) for x in operands), f"{name} reads a quantized input"
    assert not any(quantizes_input(m) for m in net.modules())
    with torch.no_grad():
        assert _bitwise_equal(_legacy_copy(net)(tokens).logits, logits)
        x = torch.randn(3, 64)
        assert gemm_input(x, net.cfg) is x
        # and the switch does something: the same weights with it on give other logits
        quant = CEDNetwork(tiny_config(runtime_fake_quant=True)).eval()
        quant.load_state_dict(net.state_dict())
        on = quant(tokens).logits
        assert not torch.equal(on, logits) and not torch.equal(_legacy_copy(quant)(tokens).logits, on)


# ----------------------------------------------------------------------------- an independent re-implementation


def release_act_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """V4.1's act_quant (quantize, then dequantize) written from its recipe, independently of quant_formats: per block
    of 32 along the last dim, scale = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) read off the fp32 bits (exponent,
    plus one when any mantissa bit is set), values clamped to +-448 and cast to e4m3 (round to nearest even)."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    bits = (amax * torch.tensor(1 / 448, dtype=torch.float32)).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int()
    scale = ((exponent + 127) << 23).view(torch.float32)
    q = (xb / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)


def _hard_values(n: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of 32 that hit the corners: spread magnitudes, all-zero and sub-floor blocks, exact e4m3 ties, amax on a
    binade edge (x/scale == 448 and == 224), signed zeros."""
    x = (torch.randn(n, 32, generator=generator)
         * torch.exp2(torch.randint(-30, 30, (n, 1), generator=generator).float()))
    x[0] = 0.0
    x[1] = torch.randn(32, generator=generator) * 1e-6
    # 1.0625: tie between 1 and 1.125
    x[2, :] = torch.tensor([448.0, 224.0, -1.0625, 1.1875, 3.0 * 2**-10] * 6 + [-0.0, 0.0])
    x[3] = x[2] * 2.0**-20
    x[4, :] = 0.0
    x[4, 0] = 448.0 * 2**-3
    return x


def test_fp8_qdq_is_the_release_act_quant(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = _hard_values(4096, g)
    assert _bitwise_equal(fp8_qdq(x, 32), release_act_quant(x))


def test_expert_and_query_projection_match_a_plain_rewrite(seed: int) -> None:
    """One expert (with a routing weight) and layer 2's query path (wq_a, q_norm, wq_b), recomputed from the weights
    with the release recipe's act_quant: the same bits."""
    cfg = tiny_config(runtime_fake_quant=True)
    expert = Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, quantize_input=True)
    for w in (expert.w1, expert.w2, expert.w3):
        nn.init.normal_(w.weight, std=0.3)
    x = torch.randn(9, cfg.dim) * 3.0
    weight = torch.rand(9)
    gate = F.linear(release_act_quant(x), expert.w1.weight).clamp(max=cfg.swiglu_limit)
    up = F.linear(release_act_quant(x), expert.w3.weight).clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    h = F.silu(gate) * up * weight.unsqueeze(-1)
    with torch.no_grad():
        assert _bitwise_equal(expert(x, weight), F.linear(release_act_quant(h), expert.w2.weight))

        net = tiny_network(cfg)
        attn = net.layers["2"].attn
        seen: dict[str, Any] = {}

        def keep(key: str, take_input: bool):  # type: ignore[no-untyped-def]
            def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
                # a hook returning a value would replace the output
                seen.setdefault(key, inputs[0] if take_input else output)
            return hook

        attn.wq_a.register_forward_hook(keep("x", True))
        attn.wq_b.register_forward_hook(keep("q", False))
        net(torch.randint(0, cfg.vocab_size, (1, LENGTH)))
        a = F.linear(release_act_quant(seen["x"]), attn.wq_a.weight)
        qr = attn.q_norm.weight * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + cfg.norm_eps))
        assert _bitwise_equal(seen["q"], F.linear(release_act_quant(qr), attn.wq_b.weight))


def test_a_quantized_projection_needs_whole_blocks() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        ActQuantLinear(48, 8, quantize_input=True)
    ActQuantLinear(48, 8, quantize_input=False)
