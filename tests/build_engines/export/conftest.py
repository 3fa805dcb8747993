"""What the engine-path tests of this package share: the tiny network exported once (about a minute per variant)."""

from __future__ import annotations

import zlib

import pytest
import torch

from build_engines.build.onnx_build import GRAPH_FILES, build_onnx, ort_runner
from ced.formats.checkpoint import save_checkpoint
from ced.steps.decoder_step import DecoderStep
from ced.steps.encoder_step import EncoderStep
from ced.steps.engram_feed import EngramFeed
from ced.steps.layout import StepLayout
from ced.steps.parity import torch_runner
from tests.ced.model.test_engram import engram_network
from tests.tiny import tiny_network


@pytest.fixture(scope="package", params=["plain", "engram"])
def exported(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny network's engines, without and with Engram (layers 1 and 2: the encoder graph takes rows the host
    gathers from the checkpoint's memory-mapped tables, `EngramFeed`)."""
    chosen = request.config.getoption("--seed")  # tests/conftest.py: fixed per variant unless --seed says otherwise
    if chosen == "random":
        seed = int(torch.seed() % 2**31)
    else:
        seed = int(chosen) if chosen is not None else zlib.crc32(f"exported-{request.param}".encode()) & 0x7FFFFFFF
    print(f"export seed: {seed} (replay with --seed {seed})")
    torch.manual_seed(seed)
    net = tiny_network() if request.param == "plain" else engram_network()
    model_dir = save_checkpoint(net, tmp_path_factory.mktemp("tiny_model"))
    out = tmp_path_factory.mktemp("tiny_engines")
    graphs, parity = build_onnx(model_dir, out)
    layout = StepLayout(net.cfg)
    engram = EngramFeed.open(model_dir, layout)
    if engram is not None:  # the checkpoint has no tokenizer: the feed hashes with the placeholder map, so must the net
        net.set_engram_token_map(engram.hasher.token_map)
    enc, dec = net.split()
    modules = {
        "encoder": torch_runner(EncoderStep(enc).eval(), layout.encoder_inputs(), layout.encoder_outputs()),
        "decoder": torch_runner(DecoderStep(dec).eval(), layout.decoder_inputs(), layout.decoder_outputs()),
    }
    sessions = {name: ort_runner(out / GRAPH_FILES[name]) for name in GRAPH_FILES}
    return {"dir": out, "graphs": graphs, "parity": parity, "layout": layout, "torch": modules, "onnx": sessions,
            "engram": engram, "model_dir": model_dir}
