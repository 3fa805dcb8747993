"""Plant a known bug under each of the project's claims, in a scratch copy, and show that the suite fails.

Each mutation is an exact text replacement in one source file (the script refuses one whose text is not found
exactly once, so the list cannot silently go stale as the code moves) plus the tests expected to catch it. For each:
the working tree (tracked and untracked files, not ignored ones) is copied to a scratch folder with the embedded
default's built engines, the bug is planted there, and those tests run there, on a venv that puts the copy before
the project's packages (`make_overlay_env`: tritonserver's stubs then import the planted code too; the Dynamo
workers get the copy on their `PYTHONPATH`). A mutation counts as caught when pytest
exits 1 with at least one test failed; `--control` first runs the same tests on an unmodified copy, which must pass.

    .venv/bin/python scripts/mutation_check.py                  # every mutation (about 20 min on 2 cores)
    .venv/bin/python scripts/mutation_check.py --only M1 M2     # some of them
    .venv/bin/python scripts/mutation_check.py --control --write-doc   # + the clean run; the table into docs/testing.md
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- mutation-results:begin -->", "<!-- mutation-results:end -->"
SHARED = (".venv", ".venv-dynamo", ".venv-quant")  # environments the copy uses in place (linked, never written)
ENGINES = Path("artifacts/engines/mol2-small")  # copied: the tests' default_engines fixture reuses it when current


@dataclass(frozen=True)
class Mutation:
    key: str
    claim: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    every_test: bool = False  # run all its tests (not stopping at the first failure): show each layer catches it


SI = "tests/tritonserver_backend/test_source_independence.py"
TOKENS_UNIT = "tests/tritonserver_backend/test_session_auth.py"
TOKENS_SERVED = "tests/tritonserver_backend/test_serving_session_tokens.py"
EX = "tests/tritonserver_backend/test_serving_exactness.py"
JOURNAL = "tests/tritonserver_backend/test_session_journal.py"
FAULTS = "tests/tritonserver_backend/test_fault_healing.py"
LEASES = "tests/tritonserver_backend/test_turn_leases.py"
MUTATIONS = (
    Mutation("M1", "source independence: a turn is replayed under its own adapter",
             "DecoderService replays a starting turn under the adapter that answered the session's previous turn",
             "tritonserver_backend/core/decoder_service.py",
             "        slots = [t.slot for t in turns]\n"
             "        feed = decoder_inputs(self.layout, [t.row for t in turns], None, slots)",
             "        slots = [t.row.slot for t in turns]\n"
             "        feed = decoder_inputs(self.layout, [t.row for t in turns], None, slots)",
             (SI, f"{EX}::test_the_served_turn_after_any_source_adapter_equals_a_rebuilt_session",
              "tests/dynamo_deploy/test_source_independence.py"), True),
    Mutation("M2", "batched replay: front padding is invisible",
             "a batched replay's front-padding rows become visible (ring_start = the padded start)",
             "ced/steps/rows.py",
             "        ring_starts = [r.position - r.replay_count for r in rows]",
             "        ring_starts = starts",
             ("tests/build_engines/export/test_batched_replay.py", SI,
              f"{EX}::test_concurrent_conversations_match_the_reference_network"), True),
    Mutation("M3", "bounded replay: the last W positions, no fewer",
             "the bounded replay runs the last W - 1 positions instead of W",
             "ced/steps/rows.py",
             "        return min(self.position, self.recent[\"streams\"].shape[0])",
             "        return min(self.position, self.recent[\"streams\"].shape[0] - 1)",
             (f"{EX}::test_concurrent_conversations_match_the_reference_network",)),
    Mutation("M4", "batching: a row computes what it computes alone (LoRA grid)",
             "the LoRA grid overwrites the first row of a slot that carries more than two rows",
             "ced/steps/lora_grid.py",
             "        first = filled[u]\n",
             "        first = filled[u] % (2 * steps)\n",
             ("tests/build_engines/export/test_batched_replay.py", "tests/build_engines/export/test_lora_grid.py")),
    Mutation("M5", "routing: an explicit adapter always wins",
             "the router scores turns that name the base model instead of taking \"base\" as given",
             "tritonserver_backend/core/router_service.py",
             "            if name:\n                try:",
             "            if name and name != BASE_NAME:\n                try:",
             ("tests/tritonserver_backend/test_serving_library.py::test_router_explicit_adapter_wins_in_a_mixed_batch",
              "tests/tritonserver_backend/test_serving_triton.py::"
              "test_multi_turn_session_matches_in_process_reference")),
    Mutation("M6", "the adapter's identity is its 31-bit FNV-1a hash",
             "the hash multiplies by the wrong FNV prime",
             "ced/lora/identity.py",
             "h = (h * 0x01000193) & 0xFFFFFFFF",
             "h = (h * 0x01000197) & 0xFFFFFFFF",
             ("tests/ced/lora/test_lora.py",)),
    Mutation("M7", "bad input loses nothing: a rejected turn is rolled back",
             "the encoder's rollback forgets to restore the session it replaced",
             "tritonserver_backend/core/encoder_service.py",
             "            self._store(session_id, before)",
             "            pass",
             ("tests/tritonserver_backend/test_serving_library.py::test_a_turn_rejected_by_the_decoder_is_rolled_back",
              "tests/tritonserver_backend/test_serving_library.py::test_pipeline_errors_lose_nothing")),
    Mutation("M8", "sessions: a lost session is rebuilt from its history",
             "a session rebuilt from history drops the history's last message",
             "tritonserver_backend/core/text_service.py",
             "            history = _parse_history(history_json) if history_json else []",
             "            history = _parse_history(history_json)[:-1] if history_json else []",
             ("tests/tritonserver_backend/test_serving_library.py::test_history_rebuilds_a_lost_session", SI)),
    Mutation("M9", "streaming: every token reaches the client, whatever the stream interval",
             "a grouped stream (stream_interval > 1) drops the tokens left unsent when the turn ends",
             "tritonserver_backend/triton/decoder_dispatch.py",
             "        if turn.unsent:\n            self._flush(turn, sender, \"\", 0)",
             "        if turn.unsent and token >= 0:\n            self._flush(turn, sender, \"\", 0)",
             ("tests/tritonserver_backend/test_serving_stream_interval.py",)),
    Mutation("M10", "fp8 KV state: rows keep exactly the codes the graph wrote",
             "fp8 encoding drops the sign bit (a negative entry comes back positive)",
             "ced/steps/rows.py",
             "    return codes | (np.signbit(v).astype(np.uint8) << 7)",
             "    return codes",
             ("tests/build_engines/quantize/test_kv_codec.py",)),
    Mutation("M11", "admin security: only the admin key loads adapters",
             "the admin key check accepts any key of the right length",
             "tritonserver_backend/auth/admin_auth.py",
             "hmac.compare_digest(",
             "(lambda a, b: len(a) == len(b))(",
             ("tests/tritonserver_backend/test_admin_auth.py",)),
    Mutation("M12", "logprobs are the model's own distribution",
             "returned log-probabilities are those of a temperature-scaled distribution, not the model's",
             "tritonserver_backend/core/decoder_service.py",
             "            assert turn.logits is not None\n"
             "            turn.logprobs.append(token_logprobs(turn.logits, token, turn.params.top_logprobs))",
             "            assert turn.logits is not None\n"
             "            turn.logprobs.append(token_logprobs(turn.logits / 1.25, token, turn.params.top_logprobs))",
             (f"{EX}::test_concurrent_conversations_match_the_reference_network",)),
    Mutation("M13", "quantization: only weight GEMMs are quantized; LoRA and attention products stay fp32",
             "ModelOpt is asked to quantize every MatMul, the LoRA and activation x activation products included",
             "build_engines/quantize/ptq_worker.py",
             "nodes_to_quantize=exact(nodes),\n                 nodes_to_exclude=exact(others),",
             "nodes_to_quantize=exact(nodes + others),\n                 nodes_to_exclude=[],",
             ("tests/build_engines/quantize/test_quant_engines.py::test_lora_inputs_stay_in_high_precision[int8]",
              "tests/build_engines/quantize/test_quant_engines.py::"
              "test_perplexity_stays_within_the_bound_of_the_fp32_engine[int8]"),
             True),
    Mutation("M14", "session tokens: a live session opens with its own token only",
             "the token check accepts any token (or none) for a live session",
             "tritonserver_backend/auth/session_auth.py",
             '        return held is not None and hmac.compare_digest(held, token_digest(token) or "-")',
             "        return held is not None",
             (TOKENS_UNIT,
              f"{TOKENS_SERVED}::test_a_stranger_is_refused_everything_and_the_owner_continues_undisturbed"), True),
    Mutation("M15", "session tokens: a live session cannot be restarted by a stranger",
             "new_session (or history) on a live id skips the token check",
             "tritonserver_backend/core/encoder_service.py",
             "        if existed:\n",
             "        if existed and not restart:\n",
             (TOKENS_UNIT,
              f"{TOKENS_SERVED}::test_a_stranger_is_refused_everything_and_the_owner_continues_undisturbed"), True),
    Mutation("M16", "internal calls: only the decoder steps, rolls back or drops an encoder session",
             "the encoder takes STEP / ROLLBACK / DROP_SESSION without the server's internal key",
             "model_repository/encoder/1/model.py",
             "        if internal and not self.key.matches(glue.read(request, c.INTERNAL_KEY, None)):",
             "        if False and internal and not self.key.matches(glue.read(request, c.INTERNAL_KEY, None)):",
             (f"{TOKENS_SERVED}::test_direct_calls_to_the_internal_models_cannot_touch_a_session",)),
    Mutation("M17", "internal calls: a hand-over grant is taken once",
             "the decoder takes a grant again (the ledger accepts a grant as new as the session's last)",
             "tritonserver_backend/auth/session_auth.py",
             "            if issued_ns <= self._last.get(session_id, 0):",
             "            if issued_ns < self._last.get(session_id, 0):",
             (TOKENS_UNIT, f"{TOKENS_SERVED}::test_direct_calls_to_the_internal_models_cannot_touch_a_session"), True),
    Mutation("M18", "faults: a resumed session holds every token of its conversation",
             "the session journal leaves out the tokens the decoder's steps feed (the replies)",
             "tritonserver_backend/core/encoder_service.py",
             "            for lease, fed in zip(leases, tokens):\n                self._journal_tokens(lease, fed)",
             "            for lease, fed in zip(leases, tokens):\n                pass",
             (JOURNAL, f"{FAULTS}::test_a_killed_tritonserver_heals_and_keeps_eight_sessions")),
    Mutation("M19", "faults: a resumed session keeps its own token only",
             "a session resumed from the journal opens with any token",
             "tritonserver_backend/core/encoder_service.py",
             "        if self.tokens.enabled and not _same_digest(entry.digest, session_token):",
             "        if False:",
             (JOURNAL,)),
    Mutation("M20", "faults: a dead model process is noticed",
             "the supervisor watches only the server process, not its stubs",
             "tritonserver_backend/launcher/supervisor.py",
             "            if not same_process(stub.pid, stub.start_ticks):\n"
             "                why = self._ended_on_purpose(server, stub)",
             "            if False:\n"
             "                why = self._ended_on_purpose(server, stub)",
             ("tests/tritonserver_backend/test_supervisor.py",
              f"{FAULTS}::test_a_killed_model_process_heals_and_keeps_every_session")),
    Mutation("M21", "leases: a turn nobody continues gives its slot back",
             "a handed-over turn's lease never expires (the slots of abandoned turns stay taken)",
             "tritonserver_backend/core/turn_lease.py",
             "                if lease.status == HANDED_OVER and lease.deadline <= now]",
             "                if False]",
             (f"{LEASES}::test_an_unclaimed_turn_gives_its_slot_back_when_its_lease_ends",
              "tests/tritonserver_backend/test_serving_load.py::test_turns_nobody_continues_cannot_lock_the_server")),
    Mutation("M22", "pins: a cache entry a turn took is never evicted from under it",
             "a prefix-cache hit is pinned only when its session rests on it (the entry can be evicted before)",
             "tritonserver_backend/core/encoder_service.py",
             "            hit = self.prefix_cache.lookup(salt, turn.chain, pin=True)\n"
             "            if hit is not None:\n"
             "                lease.pins.append(hit.entry)\n",
             "            hit = self.prefix_cache.lookup(salt, turn.chain)\n"
             "            if hit is not None:\n",
             (f"{LEASES}::test_a_cache_entry_a_turn_took_is_pinned_until_its_turn_ends",)),
)


def scratch_copy(dest: Path) -> None:
    """The working tree as git sees it (tracked + untracked, not ignored), the default's engines, linked venvs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if (ROOT / ENGINES).is_dir():
        shutil.copytree(ROOT / ENGINES, dest / ENGINES)
    for env in SHARED:
        if (ROOT / env).exists():
            (dest / env).symlink_to(ROOT / env)
    make_overlay_env(dest)


OVERLAY = ".venv-mutation"


def make_overlay_env(dest: Path) -> Path:
    """A venv whose site-packages lists the copy first, then the project venv's packages (by a .pth file, so the
    venv's editable install, which points at this checkout, is not loaded). Why not PYTHONPATH alone: tritonserver's
    Python-backend stub embeds an interpreter that ignores it, and would import this checkout's code; the stub takes
    the environment of the `python3` first on PATH, which the launcher makes the running interpreter's."""
    env = dest / OVERLAY
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next(env.glob("lib/python3*/site-packages"))
    main_site = next((ROOT / ".venv").glob("lib/python3*/site-packages"))
    (site / "mol2_mutation_copy.pth").write_text(f"{dest}\n{main_site}\n")
    return env / "bin" / "python"


def plant(dest: Path, m: Mutation) -> None:
    path = dest / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.key}: the text to replace occurs {text.count(m.old)} times in {m.path}; update the "
                         "mutation")
    path.write_text(text.replace(m.old, m.new))


def run_tests(dest: Path, tests: tuple[str, ...], log: Path, stop_first: bool = True) -> tuple[int, list[str], float]:
    """pytest on `tests` inside the copy -> (exit code, failed test ids, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run([str(dest / OVERLAY / "bin" / "python"), "-m", "pytest", "-q", "-m", "", "-p",
                             "no:cacheprovider", *(["-x"] if stop_first else []), *tests],
                            cwd=dest, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log.read_text(), re.M)
    return rc, failed, time.perf_counter() - t0


def write_doc(rows: list[str], keys: list[str], header: list[str], control: bool) -> None:
    """The result table in docs/testing.md: the rows of this run replace those of the same mutations, the others stay
    (with the run that measured them named in a note), so a run of some mutations does not erase the rest."""
    text = DOC.read_text()
    old = re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), text, flags=re.S)
    kept = [line for line in (old.group(1) if old else "").splitlines() if re.match(r"\| M\d+ \|", line)]
    by_key = {line.split("|")[1].strip(): line for line in kept}
    by_key.update(dict(zip(keys, rows)))
    ordered = [by_key[k] for k in sorted(by_key, key=lambda k: int(k[1:]))]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = f"`scripts/mutation_check.py{' --control' if control else ''} --only {' '.join(keys)} --write-doc`"
    note = (f"Rows {', '.join(keys)}: run {stamp} on this machine ({how}); the other rows are from the earlier run "
            "named above them.")
    previous = next((line for line in (old.group(1) if old else "").splitlines() if line.startswith("Run ")), "")
    block = "\n".join([BEGIN, previous, note, "", *header, *ordered, END])
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="mutation keys (M1 M2 ...); default: all")
    p.add_argument("--control", action="store_true", help="first run every selected test on an unmodified copy")
    p.add_argument("--write-doc", action="store_true", help=f"write the result table into {DOC.relative_to(ROOT)}")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies and logs (printed)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.key in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.key}  {m.claim}\n     bug: {m.bug} ({m.path})\n     tests: {' '.join(m.tests)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="mol2-mutations-"))
    rows, ok = [], True
    if args.control:
        dest = work / "control"
        scratch_copy(dest)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, failed, seconds = run_tests(dest, tests, work / "control.log")
        print(f"control: pytest exit {rc} in {seconds:.0f} s{'' if rc == 0 else ', failed: ' + ' '.join(failed)}")
        if rc != 0:
            print(f"the unmodified copy fails: see {work / 'control.log'}")
            return 1
        if not args.keep:
            shutil.rmtree(dest)
    for m in tqdm(chosen, desc="mutations", unit="bug"):
        dest = work / m.key
        scratch_copy(dest)
        plant(dest, m)
        rc, failed, seconds = run_tests(dest, m.tests, work / f"{m.key}.log", not m.every_test)
        caught = rc == 1 and bool(failed)
        ok &= caught
        verdict = "caught" if caught else f"NOT caught (pytest exit {rc})"
        tqdm.write(f"{m.key}: {verdict} in {seconds:.0f} s; failed: {', '.join(failed) or '-'}")
        rows.append(f"| {m.key} | {m.claim} | {m.bug} (`{m.path}`) | {verdict} | "
                    f"{'<br>'.join(f'`{f}`' for f in failed) or '-'} |")
        if not args.keep:
            shutil.rmtree(dest)
    every = ", ".join(m.key for m in MUTATIONS if m.every_test)
    header = [
        f"| | claim | planted bug | result | failing tests (all of them for {every}; else pytest -x: the first) |",
        "|---|---|---|---|---|"]
    print("\n".join(header + rows))
    if args.write_doc:
        write_doc(rows, [m.key for m in chosen], header, args.control)
    print(f"logs: {work}" if args.keep else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
