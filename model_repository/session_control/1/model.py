"""session_control: "cancel" stops a session's turn in flight (a client whose stream is gone, an impatient user).

Triton 2.51 does not pass a client's cancellation on to an ensemble step that is already running, so the decoder
cannot see a closed stream by itself; this model forwards the request to the decoder (BLS) and answers its outcome.
"""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend import triton_glue as glue


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                result = glue.bls_control(glue.read(request, c.SESSION_ID), glue.read(request, c.CONTROL_ACTION))
                responses.append(glue.response({c.RESULT: result}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
