"""encoder: the adapter-free encoder engine; a user turn (prefill) or the decoder's batched per-token step.

Every request is read and answered on one worker thread (`pb_utils` objects are not thread-safe, turn_worker.py):
`execute` only queues them. Calls that take one engine call or none (the decoder's steps, rollbacks, token checks)
are answered at once, in arrival order; a user turn is checked and taken in flight at once, then its prefill runs one
piece per iteration between them (prefill_queue.py), and its response is sent once it is encoded. The model stays
non-decoupled (one response per request, sent through the request's response sender): clients, the ensemble and BLS
call it as before.
"""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend.auth.session_auth import (
    InternalKey,
    first_position,
    grant_subject,
    internal_key_path,
    parse_switch,
)
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.encoder_service import DEFAULT_PREFILL_STEP, EncodedTurn, EncoderService
from tritonserver_backend.core.prefill_queue import PrefillQueue
from tritonserver_backend.core.turn_lease import DEFAULT_LEASE_S
from tritonserver_backend.core.turn_worker import TurnWorker
from tritonserver_backend.errors import BadRequest, ServerBusy
from tritonserver_backend.triton import glue
from tritonserver_backend.triton.handover_codec import to_arrays


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, _ = glue.setup(args)
        max_turns = int(params["max_active_turns"]) + int(params["max_queued_turns"])
        counters = Counters()
        glue.export_counters(counters, [k.ENCODED_TOKENS], label="kind")
        glue.export_counters(counters, [k.TURNS_REFUSED], label="reason", known=k.REFUSAL_REASONS)
        glue.export_counters(counters, [k.TOKEN_REFUSALS], label="path", known=k.TOKEN_PATHS)
        glue.export_counters(counters, [k.PREFIX_HITS, k.PREFIX_MISSES, k.PREFIX_HIT_TOKENS, k.PREFIX_EVICTIONS],
                             label="partition", known=k.PREFIX_PARTITIONS)
        session_auth = parse_switch(params.get("session_auth", "true"))
        glue.announce_session_auth("encoder", session_auth)
        self.key = InternalKey.from_file(internal_key_path(glue.resolve(args, params["registry_root"]),
                                                           params.get("internal_key_file") or None))
        glue.export_counters(counters, [k.TURN_LEASES_ENDED], label="how", known=k.LEASE_ENDINGS)
        engine = glue.engine(args, params, model_dir)
        self.service = EncoderService(engine, int(params["session_budget_bytes"]),
                                      int(params["max_context"]), int(params["prefill_chunk"]), max_turns, counters,
                                      session_auth, int(params.get("prefix_cache_bytes", "0")),
                                      glue.session_journal(args, params, engine.cfg.vocab_size),
                                      float(params.get("turn_lease_s", DEFAULT_LEASE_S)))
        self.between_steps = parse_switch(params.get("prefill_between_steps", "true"))
        self.gauges = glue.SessionGauges("encoder", self.service.sessions)
        self.cache_gauges = glue.PrefixCacheGauges(self.service.prefix_cache)
        self.prefills = PrefillQueue(self.service, self._answer_turn,
                                    int(params.get("prefill_tokens_per_step", DEFAULT_PREFILL_STEP)))
        self.worker = TurnWorker(self._handle, self._iterate, lambda: self.prefills.idle, name="mol2-encoder")

    def execute(self, requests):
        self.worker.submit(requests)  # read and answered on the worker thread; nothing else here
        return None

    def finalize(self):
        self.worker.stop()
        self.prefills.fail_all(ServerBusy("the server is shutting down; resend the turn"))

    # ------------------------------------------------------------------ the worker thread
    def _handle(self, requests):
        for request in requests:
            try:
                outputs = self._serve(request)
            except Exception as exc:  # noqa: BLE001 - one request's error never fails the others
                glue.send_final(request, glue.error_response(exc))
                continue
            if outputs is not None:
                glue.send_final(request, glue.response(outputs))
        self._update_gauges()

    def _iterate(self):
        if not self.prefills.idle:
            self.prefills.iterate()
            self._update_gauges()

    def _update_gauges(self):
        self.gauges.update()
        self.cache_gauges.update()

    def _answer_turn(self, handle, outcome):
        request, session, fork = handle
        if isinstance(outcome, BaseException):
            glue.send_final(request, glue.error_response(outcome))
            return
        glue.send_final(request, glue.response(self._turn_outputs(outcome, session, fork)))

    def _turn_outputs(self, turn: EncodedTurn, session, fork):
        grant = self.key.grant(grant_subject(session, fork), first_position(turn.handover["positions"]),
                               turn.turn_id)
        return {c.H19: turn.h19.reshape(1, -1), **glue.by_spec(c.HANDOVER, to_arrays([turn.handover])),
                c.ISSUED_TOKEN: turn.issued_token, c.GRANT: grant}

    def _serve(self, request):
        """The outputs of a call answered at once, or None for a user turn queued for its prefill."""
        session = glue.read(request, c.SESSION_ID)
        internal = (glue.read(request, c.ROLLBACK, False) or glue.read(request, c.DROP_SESSION, False)
                    or glue.read(request, c.CLAIM_TURN, False)
                    or any(glue.read(request, spec, None) is not None
                           for spec in (c.STEP_SESSION_IDS, c.STEP_KEEP, c.STEP_DRAFT, c.STEP_TURN_IDS)))
        if internal and not self.key.matches(glue.read(request, c.INTERNAL_KEY, None)):
            raise BadRequest(f"{c.ROLLBACK.name}, {c.DROP_SESSION.name}, {c.CLAIM_TURN.name}, "
                             f"{c.STEP_SESSION_IDS.name}, {c.STEP_KEEP.name}, {c.STEP_DRAFT.name} and "
                             f"{c.STEP_TURN_IDS.name} are sent by the decoder only")
        turn_ids = glue.read(request, c.STEP_TURN_IDS, None)
        if glue.read(request, c.CHECK_TOKEN, False):  # session_control's cancel: the token first
            self.service.check_token(session, glue.read(request, c.SESSION_TOKEN, None), k.PATH_CANCEL)
            return {}
        if glue.read(request, c.CLAIM_TURN, False):
            self.service.claim(session, _one_turn_id(turn_ids))
            return {}
        if glue.read(request, c.ROLLBACK, False):  # the answer says whether the turn was still open
            rolled = self.service.rollback(session, _one_turn_id(turn_ids) if turn_ids is not None else 0)
            return {c.ISSUED_TOKEN: "rolled_back" if rolled else ""}
        if glue.read(request, c.DROP_SESSION, False):
            self.service.end(session)
            return {}
        step_sessions = glue.read(request, c.STEP_SESSION_IDS, None)
        if step_sessions is not None:  # the decoder's batched step: every active session's next tokens
            rows = self.service.encode_step(step_sessions, glue.read(request, c.STEP_TOKEN_IDS),
                                            bool(glue.read(request, c.TURN_DONE, False)),
                                            glue.read(request, c.STEP_KEEP, None),
                                            bool(glue.read(request, c.STEP_DRAFT, False)), turn_ids)
            return {c.H19: glue.empty_h19(), **glue.by_spec(c.HANDOVER, to_arrays(rows)), c.ISSUED_TOKEN: "",
                    c.GRANT: ""}
        fork = glue.read(request, c.FORK_FROM, None)
        args = (session, glue.read(request, c.TOKEN_IDS), glue.read(request, c.PREFIX_IDS),
                bool(glue.read(request, c.START)), glue.read(request, c.SESSION_TOKEN, None), fork,
                glue.read(request, c.FORK_TOKEN, None), glue.read(request, c.CACHE_SALT, None))
        if not self.between_steps:  # the whole prefill now, before any other call
            return self._turn_outputs(self.service.encode_turn(*args), session, fork)
        self.prefills.add((request, session, fork), self.service.begin_turn(*args))
        return None


def _one_turn_id(turn_ids):
    """A claim's or rollback's one turn id (STEP_TURN_IDS of one element)."""
    if turn_ids is None or len(turn_ids) != 1:
        raise BadRequest(f"{c.STEP_TURN_IDS.name} must name one turn with {c.CLAIM_TURN.name} or {c.ROLLBACK.name}")
    return int(turn_ids[0])
