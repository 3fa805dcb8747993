"""encoder: runs the adapter-free encoder engine for a session; outputs H19 and the hand-over rows."""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend import triton_glue as glue
from tritonserver_backend.encoder_service import EncoderService
from tritonserver_backend.handover_codec import to_arrays


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, _ = glue.setup(args)
        self.service = EncoderService(model_dir, int(params["session_budget_bytes"]), int(params["max_context"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                session = glue.read(request, c.SESSION_ID)
                if glue.read(request, c.DROP_SESSION, False) or glue.read(request, c.ROLLBACK, False):
                    if glue.read(request, c.ROLLBACK, False):
                        self.service.rollback(session)
                    else:
                        self.service.end(session)
                    responses.append(glue.response({}))
                    continue
                h19, handover = self.service.encode(session, glue.read(request, c.TOKEN_IDS), glue.read(request, c.PREFIX_IDS), bool(glue.read(request, c.START)))
                arrays = to_arrays(handover)
                responses.append(glue.response({c.H19: h19.reshape(1, -1), **{spec: arrays[spec.name] for spec in c.HANDOVER}}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
