"""session_control: "cancel" stops a session's turn in flight (a client whose stream is gone, an impatient user).

Triton 2.51 does not pass a client's cancellation on to an ensemble step that is already running, so the decoder
cannot see a closed stream by itself; this model has the encoder check the session's token (session_auth.py), then
forwards the request to the decoder (BLS, with the server's internal key) and answers its outcome.
"""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend.auth.session_auth import InternalKey, internal_key_path
from tritonserver_backend.triton import glue


class TritonPythonModel:
    def initialize(self, args):
        params = glue.parameters(args)
        self.key = InternalKey.from_file(internal_key_path(glue.resolve(args, params["registry_root"]),
                                                           params.get("internal_key_file") or None))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                session, action = glue.read(request, c.SESSION_ID), glue.read(request, c.CONTROL_ACTION)
                glue.bls_check_token(session, glue.read(request, c.CONTROL_TOKEN, None))
                result = glue.bls_control(session, action, self.key)
                responses.append(glue.response({c.RESULT: result}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
