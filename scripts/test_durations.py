"""Where a test run's time went: each phase's wall time and test count, the slowest tests, and the servers started.

scripts/test.sh writes each pytest phase's JUnit XML and its start log (`MOL2_START_LOG`, one line per tritonserver
start or Dynamo deployment) under build/test-reports/, then runs this. Why: the suite's time is the cost every change
pays (issue 64), and a CI log that names the slowest tests and counts the server starts shows where to cut.

    .venv/bin/python scripts/test_durations.py [build/test-reports] [--slowest 20] [--write-groups FILE]

`--write-groups tests/group_durations.json` records each xdist group's seconds (the groups the workers wrote to
groups-*.json under MOL2_GROUPS_OUT): tests/conftest.py schedules the longest groups first from that file.
"""

from __future__ import annotations

import argparse
import json
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
    return sorted(((seconds, f"{classname}::{name}") for (classname, name), seconds in case_seconds(folder).items()),
                  reverse=True)[:count]


def case_seconds(folder: Path) -> dict[tuple[str, str], float]:
    """Each test's seconds by its JUnit (classname, name)."""
    out: dict[tuple[str, str], float] = {}
    for path in sorted(folder.glob("*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name", "").split("@")[0]  # xdist appends "@group" to a grouped test's id
            out[(case.get("classname", ""), name)] = float(case.get("time", 0.0))
    return out


def junit_key(nodeid: str) -> tuple[str, str]:
    """A pytest node id as JUnit names it: tests/a/test_b.py::Class::test_c[x] -> (tests.a.test_b.Class, test_c[x])."""
    parts = nodeid.split("@")[0].split("::")
    return ".".join([parts[0].removesuffix(".py").replace("/", "."), *parts[1:-1]]), parts[-1]


def group_seconds(folder: Path) -> dict[str, float]:
    """Seconds per xdist group, summed over the tests the workers ran in it, longest first."""
    groups: dict[str, str] = {}
    for path in sorted(folder.glob("groups-*.json")):
        groups.update(json.loads(path.read_text()))
    seconds = case_seconds(folder)
    totals: Counter[str] = Counter()
    for nodeid, group in groups.items():
        totals[group] += seconds.get(junit_key(nodeid), 0.0)
    return {group: round(total, 1) for group, total in totals.most_common()}


def starts(folder: Path) -> dict[str, Counter[str]]:
    """Per phase: starts counted by kind (tritonserver, tritonserver-toy, either with -heal: a supervisor's restart
    of a dead server, the subject of the fault tests; dynamo)."""
    out: dict[str, Counter[str]] = {}
    for path in sorted(folder.glob("starts-*.log")):
        kinds = Counter(line.split("\t")[1] for line in path.read_text().splitlines() if line.count("\t") >= 2)
        out[path.stem.removeprefix("starts-")] = kinds
    return out


def report(folder: Path, count: int) -> str:
    lines = ["| phase | wall (s) | tests | failed | skipped | tritonserver starts: MoL2 / toy (+ heals) "
             "| Dynamo deployments |",
             "|---|---|---|---|---|---|---|"]
    started = starts(folder)
    for name, seconds, tests, failed, skipped in phases(folder):
        kinds = started.get(name, Counter())
        heals = kinds["tritonserver-heal"] + kinds["tritonserver-toy-heal"]
        lines.append(f"| {name} | {seconds:.0f} | {tests} | {failed} | {skipped} | {kinds['tritonserver']} / "
                     f"{kinds['tritonserver-toy']} (+ {heals}) | {kinds['dynamo']} |")
    lines += ["", f"The {count} slowest tests:", "", "| seconds | test |", "|---|---|"]
    lines += [f"| {seconds:.1f} | `{name}` |" for seconds, name in slowest(folder, count)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=ROOT / "build" / "test-reports")
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("--write-groups", type=Path, help="write each xdist group's seconds to this JSON file")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"no test reports in {args.folder}")
        return 1
    print(report(args.folder, args.slowest))
    if args.write_groups:
        totals = group_seconds(args.folder)
        if totals:
            args.write_groups.write_text(json.dumps(totals, indent=1) + "\n")
            print(f"\n{len(totals)} groups' seconds written to {args.write_groups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
