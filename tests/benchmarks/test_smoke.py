"""A smoke test per benchmark: each one imports and parses its options through `python -m benchmarks NAME --help`
(from outside the checkout, as an installed user runs it); the cheap ones also run end to end at a tiny size into a
temporary doc, and their output is checked for the figures they exist to print. The expensive ones (soak, the
lm-evaluation-harness run) have tests of their own in this folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import BENCHMARKS
from benchmarks.harness import ROOT


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_parses_its_options(name: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", name, "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"COLUMNS": "200", "PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"python -m benchmarks {name}" in done.stdout


def run(*argv: str, timeout: float = 600) -> str:
    done = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


@pytest.mark.slow
def test_switch_cost_runs_small(tmp_path: Path, default_engines: Path) -> None:
    out = tmp_path / "benchmarks.md"
    printed = run("switch", "--lengths", "128", "256", "--rounds", "1", "--handoff-rounds", "1", "--out", str(out))
    text = out.read_text()
    assert "## Switch cost vs context length (benchmarks/switch.py)" in text and "| 256 |" in text
    assert "Replay at 256 / replay at 128" in printed
    assert (tmp_path / "figures" / "switch_cost.png").is_file()


@pytest.mark.slow
def test_serving_runs_small(tmp_path: Path, default_engines: Path) -> None:
    out = tmp_path / "load.md"
    run("serving", "--sessions", "1", "2", "--tokens", "6", "--rounds", "1", "--out", str(out),
        "--work", str(tmp_path / "work"))
    text = out.read_text()
    assert "python -m benchmarks serving --sessions 1 2 --tokens 6" in text
    assert "| 1 | 1 |" in text and "| 1 | 2 |" in text  # stream interval 1: one row per session count


@pytest.mark.slow
def test_prefix_cache_runs_small(tmp_path: Path, default_engines: Path) -> None:
    out = tmp_path / "prefix_cache.md"
    run("prefix-cache", "--lengths", "300", "--rounds", "1", "--out", str(out), "--work", str(tmp_path / "work"),
        "--figure", str(tmp_path / "figures" / "ttft.png"))
    text = out.read_text()
    assert "## Measured: time to first token, cold vs hit (benchmarks/prefix_cache.py)" in text
    assert "| 300 |" in text and (tmp_path / "figures" / "ttft.png").is_file()


@pytest.mark.slow
def test_prefix_state_bytes_runs_small(tmp_path: Path, default_engines: Path) -> None:
    out = tmp_path / "prefix_cache.md"
    printed = run("prefix-state-bytes", "--prompt-tokens", "300", "--sessions", "2", "--out", str(out),
                  "--figure", str(tmp_path / "figures" / "bytes.png"))
    text = out.read_text()
    assert "| with the cache |" in text and "| deepseek-v4.1-flash |" in text, printed
    assert (tmp_path / "figures" / "bytes.png").is_file()


@pytest.mark.slow
@pytest.mark.serial  # streams against a long prompt's prefill: a second busy worker starves the streams
def test_chunked_prefill_runs_small(tmp_path: Path, default_engines: Path) -> None:
    out = tmp_path / "load.md"
    run("chunked-prefill", "--long-tokens", "600", "--streams", "1", "--stream-tokens", "80", "--rounds", "1",
        "--out", str(out), "--figure", str(tmp_path / "figures" / "gaps.png"), "--work", str(tmp_path / "work"))
    text = out.read_text()
    assert "| whole prefill (before) |" in text and "| chunked between steps |" in text
    assert (tmp_path / "figures" / "gaps.png").is_file()
