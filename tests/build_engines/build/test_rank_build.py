"""`python -m build_engines build --tensor-parallel-size N`: each rank's files hold exactly what the rank would slice
from the checkpoint, the build is reused when current, refuses what does not apply, and a parallel engine serves
from it with the single-rank tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from build_engines.build.cli import main
from build_engines.build.rank_build import placement_comm
from ced.engine_dir.rank_manifest import rank_file
from ced.parallel.network import load_parallel_component
from tests.conftest import EMBEDDED


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_file_holds_exactly_the_ranks_slices(tmp_path: Path, capsys, expert_parallel: bool) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "ranks"
    argv = ["--model", str(EMBEDDED), "--out", str(out), "--tensor-parallel-size", "2"]
    argv += ["--enable-expert-parallel"] if expert_parallel else []
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["kind"], manifest["tensor_parallel_size"],
            manifest["expert_parallel"]) == ("rank-shards", 2, expert_parallel)
    whole = {role: load_parallel_component(role, EMBEDDED, placement_comm(1, 0)).state_dict()
             for role in ("encoder", "decoder")}
    for rank in range(2):
        for role in ("encoder", "decoder"):
            assert rank_file(out, rank, role).stat().st_size < (EMBEDDED / "model.safetensors").stat().st_size
            sliced = load_parallel_component(role, EMBEDDED, placement_comm(2, rank), expert_parallel).state_dict()
            read = load_parallel_component(role, EMBEDDED, placement_comm(2, rank), expert_parallel,
                                           rank_files=out).state_dict()
            assert sliced.keys() == read.keys()
            assert all(torch.equal(sliced[k], read[k]) for k in sliced), (rank, role)
            assert sum(t.numel() for t in read.values()) < sum(t.numel() for t in whole[role].values())
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out


def test_what_does_not_apply_is_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    base = ["--model", str(EMBEDDED), "--out", str(tmp_path / "x")]
    assert main([*base, "--tensor-parallel-size", "2", "--format", "trt"]) == 2
    assert "torch engine" in capsys.readouterr().err
    assert main([*base, "--enable-expert-parallel"]) == 2
    assert "2 or more ranks" in capsys.readouterr().err
    assert main([*base, "--tensor-parallel-size", "3"]) == 2
    assert "not divisible by the tensor parallel size 3" in capsys.readouterr().err


@pytest.mark.slow
def test_a_parallel_engine_serves_from_the_rank_files(tmp_path: Path) -> None:
    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline
    from tritonserver_backend.engines import EngineUnavailable
    from tritonserver_backend.sampling.params import SamplingParams

    out = tmp_path / "ranks"
    assert main(["--model", str(EMBEDDED), "--out", str(out), "--tensor-parallel-size", "2"]) == 0
    turns = [("hey, how are you doing tonight?", None), ("Make the header sticky.", "L3_design")]
    replies = []
    for size, engine_dir in ((1, None), (2, out)):
        root = tmp_path / f"registry{size}"
        ensure_registry(root, EMBEDDED)
        pipe = InProcessPipeline(EMBEDDED, root, engine_dir=engine_dir, tensor_parallel_size=size)
        if size == 2:
            assert "rank-local weights" in pipe.engine.describe()
        replies.append([pipe.chat("s", text, adapter, new_session=i == 0,
                                  params=SamplingParams(max_tokens=12)).token_ids
                        for i, (text, adapter) in enumerate(turns)])
        if size == 2:
            pipe.engine.close()  # type: ignore[attr-defined]
    assert replies[0] == replies[1]
    with pytest.raises(EngineUnavailable, match="built for tensor_parallel_size 2"):
        InProcessPipeline(EMBEDDED, tmp_path / "registry1", engine_dir=out, tensor_parallel_size=2,
                          expert_parallel=True)


@pytest.mark.slow
def test_a_rank_that_cannot_start_fails_the_step_with_its_reason(tmp_path: Path) -> None:
    """Rank 1's file is cut short: the worker dies while loading, and the first step reports that rank, how it ended
    and its last output within seconds, instead of waiting for a group that never forms."""
    import time

    from tritonserver_backend.adapters.registry_init import ensure_registry
    from tritonserver_backend.core.pipeline import InProcessPipeline
    from tritonserver_backend.engines.rank_group import RankLost

    out = tmp_path / "ranks"
    assert main(["--model", str(EMBEDDED), "--out", str(out), "--tensor-parallel-size", "2"]) == 0
    broken = rank_file(out, 1, "encoder")
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    ensure_registry(tmp_path / "registry", EMBEDDED)
    pipe = InProcessPipeline(EMBEDDED, tmp_path / "registry", engine_dir=out, tensor_parallel_size=2)
    started = time.monotonic()
    with pytest.raises(RankLost,
                       match=r"encoder group lost a rank: rank 1 of 2 exited with code 1; its last output: .*"):
        pipe.chat("s", "hello there", new_session=True)
    assert time.monotonic() - started < 60
    pipe.engine.close()  # type: ignore[attr-defined]
