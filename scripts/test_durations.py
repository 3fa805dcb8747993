"""Where a test run's time went: each phase's wall time and test count, the slowest tests, and the servers started.

scripts/test.sh writes each pytest phase's JUnit XML and its start log (`MOL2_START_LOG`, one line per tritonserver
start or Dynamo deployment) under build/test-reports/, then runs this. Why: the suite's time is the cost every change
pays (issue 64), and a CI log that names the slowest tests and counts the server starts shows where to cut.

    .venv/bin/python scripts/test_durations.py [build/test-reports] [--slowest 20]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def phases(folder: Path) -> list[tuple[str, float, int, int, int]]:
    """(phase, seconds, tests, failures + errors, skipped) for each JUnit file, in name order."""
    out = []
    for path in sorted(folder.glob("*.xml")):
        suite = ET.parse(path).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        if suite is None:
            continue
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        out.append((path.stem, float(suite.get("time", 0.0)), int(suite.get("tests", 0)), failed,
                    int(suite.get("skipped", 0))))
    return out


def slowest(folder: Path, count: int) -> list[tuple[float, str]]:
    cases = []
    for path in sorted(folder.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            cases.append((float(case.get("time", 0.0)), f"{case.get('classname', '')}::{case.get('name', '')}"))
    return sorted(cases, reverse=True)[:count]


def starts(folder: Path) -> dict[str, Counter[str]]:
    """Per phase: starts counted by kind (tritonserver, dynamo)."""
    out: dict[str, Counter[str]] = {}
    for path in sorted(folder.glob("starts-*.log")):
        kinds = Counter(line.split("\t")[1] for line in path.read_text().splitlines() if line.count("\t") >= 2)
        out[path.stem.removeprefix("starts-")] = kinds
    return out


def report(folder: Path, count: int) -> str:
    lines = ["| phase | wall (s) | tests | failed | skipped | tritonserver starts | Dynamo deployments |",
             "|---|---|---|---|---|---|---|"]
    started = starts(folder)
    for name, seconds, tests, failed, skipped in phases(folder):
        kinds = started.get(name, Counter())
        lines.append(f"| {name} | {seconds:.0f} | {tests} | {failed} | {skipped} | {kinds['tritonserver']} | "
                     f"{kinds['dynamo']} |")
    lines += ["", f"The {count} slowest tests:", "", "| seconds | test |", "|---|---|"]
    lines += [f"| {seconds:.1f} | `{name}` |" for seconds, name in slowest(folder, count)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=ROOT / "build" / "test-reports")
    parser.add_argument("--slowest", type=int, default=20)
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"no test reports in {args.folder}")
        return 1
    print(report(args.folder, args.slowest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
