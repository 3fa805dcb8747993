#!/usr/bin/env bash
# The project's test command (what CI runs through .ci/run): set up the environments, then run the whole suite, slow
# tests included.
#
#   bash scripts/test.sh              # everything, in the order below
#   bash scripts/test.sh PYTEST_ARGS  # one pytest run with these arguments, slow tests included (after the same setup)
#
# (A plain `pytest` is the fast subset: pyproject.toml deselects the `slow` marker by default; `-m ""` lifts that.)
#
# The venvs install with uv from requirements/*.lock (scripts/uv_env.sh: torch is fetched once into uv's cache and
# linked into each venv). On two cores the setup's long part is single-threaded ONNX exports. So, after .venv:
#   1. the three other environments install and the lint runs while the embedded default's engines build and the
#      corpora are prepared into artifacts/data (the tests reuse both: each step is idempotent, and a lock makes a
#      concurrent builder or preparer wait and reuse; tests/real_data.py);
#   2. every test runs on two pytest-xdist workers (--dist loadgroup), one torch thread each: tests/conftest.py
#      gives each test its group (the users of one shared server or one built-once artifact, the Dynamo deployments,
#      else its file), a worker takes a group whole, and the longest groups (tests/group_durations.json) go first;
#      each worker takes its own loopback ports (MOL2_PORT_RANGE, ced/ports.py);
#   3. the tests whose subject is load (marker `serial`) run alone afterwards, so a second busy worker cannot distort
#      what they measure.
# Step 3 is "everything step 2 did not run", so no test can fall between the two. Both steps print their slowest
# tests (--durations), so that a CI log shows where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE_START=$SECONDS
bash scripts/setup.sh --main-only
if [ "$#" -gt 0 ]; then
    bash scripts/setup_dynamo.sh
    exec .venv/bin/python -m pytest -q -m "" "$@"  # slow tests included unless the arguments say otherwise
fi

LOGS=build/test_setup
mkdir -p "$LOGS"
names=() pids=()
in_background() {  # NAME COMMAND...: run COMMAND with its output in $LOGS/NAME.log
    local name=$1; shift
    "$@" >"$LOGS/$name.log" 2>&1 &
    names+=("$name") pids+=("$!")
}
in_background dynamo-venv bash scripts/setup_dynamo.sh
in_background quant-venv bash scripts/setup_quant.sh
in_background eval-venv bash scripts/setup_eval.sh  # lm-evaluation-harness (tests/benchmarks/test_eval_harness.py)
in_background default-engines .venv/bin/python -m build_engines build --model embedded/mol2-small --out artifacts/engines/mol2-small
in_background corpora .venv/bin/python -m tests.real_data
# the layer contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md#layers) and the lint rules (lines at
# 120 included), beside the setup (one core while the engines build on two); a broken one fails the run, after the
# tests have run
( status=0; .venv/bin/lint-imports --no-cache || status=$?; .venv/bin/ruff check . || status=$?; exit $status ) \
    >"$LOGS/lint.log" 2>&1 &
lint_pid=$!
failed=0
for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
        echo "${names[$i]}: $(grep -v '^WARNING: Location' "$LOGS/${names[$i]}.log" | tail -n 1)"
    else
        echo "${names[$i]} FAILED; the end of $LOGS/${names[$i]}.log:"; tail -n 40 "$LOGS/${names[$i]}.log"; failed=1
    fi
done
[ "$failed" = 0 ] || exit 1

status=0
wait "$lint_pid" || status=$?
cat "$LOGS/lint.log"

# each phase's JUnit XML and its server starts (MOL2_START_LOG) go to build/test-reports; scripts/test_durations.py
# prints where the time went at the end
REPORTS=build/test-reports
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
echo "setup and lint: $((SECONDS - SUITE_START)) s"
MOL2_START_LOG="$REPORTS/starts-1-parallel.log" MOL2_GROUPS_OUT="$REPORTS" OMP_NUM_THREADS=1 \
    .venv/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not serial" --durations=25 \
    --junitxml="$REPORTS/1-parallel.xml" tests || status=$?  # one torch thread a worker: two would spin on two cores
MOL2_START_LOG="$REPORTS/starts-2-serial.log" .venv/bin/python -m pytest -q -m "serial" --durations=10 \
    --junitxml="$REPORTS/2-serial.xml" tests || status=$?
.venv/bin/python scripts/test_durations.py "$REPORTS" || true
echo "test suite wall time: $((SECONDS - SUITE_START)) s"
exit "$status"
