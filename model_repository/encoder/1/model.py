"""encoder: the adapter-free encoder engine; a user turn (prefill) or the decoder's batched per-token step."""

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
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.errors import BadRequest
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
        self.service = EncoderService(glue.engine(args, params, model_dir), int(params["session_budget_bytes"]),
                                      int(params["max_context"]), int(params["prefill_chunk"]), max_turns, counters,
                                      session_auth, int(params.get("prefix_cache_bytes", "0")))
        self.gauges = glue.SessionGauges("encoder", self.service.sessions)
        self.cache_gauges = glue.PrefixCacheGauges(self.service.prefix_cache)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(glue.response(self._serve(request)))
            except Exception as exc:  # noqa: BLE001 - one request's error never fails the others
                responses.append(glue.error_response(exc))
        self.gauges.update()
        self.cache_gauges.update()
        return responses

    def _serve(self, request):
        session = glue.read(request, c.SESSION_ID)
        internal = glue.read(request, c.ROLLBACK, False) or glue.read(request, c.DROP_SESSION, False) or any(
            glue.read(request, spec, None) is not None for spec in (c.STEP_SESSION_IDS, c.STEP_KEEP, c.STEP_DRAFT))
        if internal and not self.key.matches(glue.read(request, c.INTERNAL_KEY, None)):
            raise BadRequest(f"{c.ROLLBACK.name}, {c.DROP_SESSION.name}, {c.STEP_SESSION_IDS.name}, {c.STEP_KEEP.name} "
                             f"and {c.STEP_DRAFT.name} are sent by the decoder only")
        if glue.read(request, c.CHECK_TOKEN, False):  # session_control's cancel: the token first
            self.service.check_token(session, glue.read(request, c.SESSION_TOKEN, None), k.PATH_CANCEL)
            return {}
        if glue.read(request, c.ROLLBACK, False):
            self.service.rollback(session)
            return {}
        if glue.read(request, c.DROP_SESSION, False):
            self.service.end(session)
            return {}
        step_sessions = glue.read(request, c.STEP_SESSION_IDS, None)
        if step_sessions is not None:  # the decoder's batched step: every active session's next tokens
            rows = self.service.encode_step(step_sessions, glue.read(request, c.STEP_TOKEN_IDS),
                                            bool(glue.read(request, c.TURN_DONE, False)),
                                            glue.read(request, c.STEP_KEEP, None),
                                            bool(glue.read(request, c.STEP_DRAFT, False)))
            return {c.H19: glue.empty_h19(), **glue.by_spec(c.HANDOVER, to_arrays(rows)), c.ISSUED_TOKEN: "",
                    c.GRANT: ""}
        fork = glue.read(request, c.FORK_FROM, None)
        turn = self.service.encode_turn(session, glue.read(request, c.TOKEN_IDS), glue.read(request, c.PREFIX_IDS),
                                        bool(glue.read(request, c.START)), glue.read(request, c.SESSION_TOKEN, None),
                                        fork, glue.read(request, c.FORK_TOKEN, None),
                                        glue.read(request, c.CACHE_SALT, None))
        grant = self.key.grant(grant_subject(session, fork), first_position(turn.handover["positions"]))
        return {c.H19: turn.h19.reshape(1, -1), **glue.by_spec(c.HANDOVER, to_arrays([turn.handover])),
                c.ISSUED_TOKEN: turn.issued_token, c.GRANT: grant}
