"""encoder: the adapter-free encoder engine; a user turn (prefill) or the decoder's batched per-token step."""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend import counters as k
from tritonserver_backend import triton_glue as glue
from tritonserver_backend.counters import Counters
from tritonserver_backend.encoder_service import EncoderService
from tritonserver_backend.handover_codec import to_arrays


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, _ = glue.setup(args)
        max_turns = int(params["max_active_turns"]) + int(params["max_queued_turns"])
        counters = Counters()
        glue.export_counters(counters, [k.ENCODED_TOKENS], label="kind")
        glue.export_counters(counters, [k.TURNS_REFUSED], label="reason", known=k.REFUSAL_REASONS)
        self.service = EncoderService(glue.engine(args, params, model_dir), int(params["session_budget_bytes"]), int(params["max_context"]),
                                      int(params["prefill_chunk"]), max_turns, counters)
        self.gauges = glue.SessionGauges("encoder", self.service.sessions)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(glue.response(self._serve(request)))
            except Exception as exc:  # noqa: BLE001 - one request's error never fails the others
                responses.append(glue.error_response(exc))
        self.gauges.update()
        return responses

    def _serve(self, request):
        session = glue.read(request, c.SESSION_ID)
        if glue.read(request, c.ROLLBACK, False):
            self.service.rollback(session)
            return {}
        if glue.read(request, c.DROP_SESSION, False):
            self.service.end(session)
            return {}
        step_sessions = glue.read(request, c.STEP_SESSION_IDS, None)
        if step_sessions is not None:  # the decoder's batched step: every active session's next tokens
            rows = self.service.encode_step(step_sessions, glue.read(request, c.STEP_TOKEN_IDS), bool(glue.read(request, c.TURN_DONE, False)))
            return {c.H19: glue.empty_h19(), **glue.by_spec(c.HANDOVER, to_arrays(rows))}
        h19, rows = self.service.encode_turn(session, glue.read(request, c.TOKEN_IDS), glue.read(request, c.PREFIX_IDS), bool(glue.read(request, c.START)))
        return {c.H19: h19.reshape(1, -1), **glue.by_spec(c.HANDOVER, to_arrays([rows]))}
