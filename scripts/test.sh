#!/usr/bin/env bash
# The project's test command (what CI runs through .ci/run): set up the environments, then run the whole suite, slow
# tests included.
#
#   bash scripts/test.sh              # everything, in the order below
#   bash scripts/test.sh PYTEST_ARGS  # one pytest run with these arguments, slow tests included (after the same setup)
#
# (A plain `pytest` is the fast subset: pyproject.toml deselects the `slow` marker by default; `-m ""` lifts that.)
#
# On two cores most of the time went to work that leaves the second core idle: pip installing .venv-dynamo,
# .venv-quant and .venv-eval, and single-threaded ONNX exports. So, after .venv:
#   1. the three other environments install while the embedded default's engines build and the corpora are prepared
#      into artifacts/data (the tests reuse both: each step is idempotent, and a lock makes a concurrent builder or
#      preparer wait and reuse; tests/real_data.py);
#   2. the build-stage and plugin tests (exports, quantized builds, kernels; no server, no timing) run on two pytest-xdist
#      workers, a file per worker;
#   3. every other test runs in one process: they start tritonservers, Dynamo workers and clients, and some check
#      latencies, which a second busy worker would distort.
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
failed=0
for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
        echo "${names[$i]}: $(grep -v '^WARNING: Location' "$LOGS/${names[$i]}.log" | tail -n 1)"
    else
        echo "${names[$i]} FAILED; the end of $LOGS/${names[$i]}.log:"; tail -n 40 "$LOGS/${names[$i]}.log"; failed=1
    fi
done
[ "$failed" = 0 ] || exit 1

# the layer contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md#layers) and the lint rules (lines at
# 120 included): a broken one fails the run, after the tests have run
status=0
.venv/bin/lint-imports --no-cache || status=$?
.venv/bin/ruff check . || status=$?

# each phase's JUnit XML and its server starts (MOL2_START_LOG) go to build/test-reports; scripts/test_durations.py
# prints where the time went at the end
REPORTS=build/test-reports
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
echo "setup and lint: $((SECONDS - SUITE_START)) s"
PARALLEL=(tests/ced tests/build_engines tests/plugins tests/test_collection.py tests/test_docs.py)
MOL2_START_LOG="$REPORTS/starts-1-build.log" OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "" \
    --durations=15 --junitxml="$REPORTS/1-build.xml" "${PARALLEL[@]}" || status=$?  # one torch thread a worker: two would spin on two cores
MOL2_START_LOG="$REPORTS/starts-2-serving.log" .venv/bin/python -m pytest -q -m "" --durations=25 \
    --junitxml="$REPORTS/2-serving.xml" tests "${PARALLEL[@]/#/--ignore=}" || status=$?
.venv/bin/python scripts/test_durations.py "$REPORTS" || true
echo "test suite wall time: $((SECONDS - SUITE_START)) s"
exit "$status"
