"""postprocess: token id -> text piece, adapter hash -> adapter name."""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend import triton_glue as glue
from tritonserver_backend.text_service import TextService


class TritonPythonModel:
    def initialize(self, args):
        _, model_dir, self.registry = glue.setup(args)
        self.text = TextService(model_dir)

    def execute(self, requests):
        responses = []
        self.registry.refresh()
        for request in requests:
            try:
                token = int(glue.read(request, c.TOKEN_ID))
                name = self.registry.name_of(int(glue.read(request, c.ADAPTER_HASH_APPLIED)))
                outputs = {c.TEXT_OUTPUT: self.text.piece(token), c.TOKEN_ID_OUT: token, c.ADAPTER_NAME: name, c.FINISH_REASON: glue.read(request, c.FINISH)}
                responses.append(glue.response(outputs))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
