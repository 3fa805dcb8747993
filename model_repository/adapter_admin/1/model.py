"""adapter_admin: load / update / unload / list adapters at run time, by path; refuses bad placements at load."""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend import triton_glue as glue
from tritonserver_backend.admin_service import AdminService


class TritonPythonModel:
    def initialize(self, args):
        _, model_dir, registry = glue.setup(args)
        self.service = AdminService(model_dir, registry)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                result = self.service.handle(glue.read(request, c.ACTION), glue.read(request, c.ADAPTER, ""), glue.read(request, c.ADAPTER_PATH, ""), glue.read(request, c.DESCRIPTION, ""))
                responses.append(glue.response({c.RESULT: result}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
