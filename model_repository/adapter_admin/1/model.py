"""adapter_admin: load / update / unload / list adapters at run time, by path; refuses bad placements at load.

`load` and `unload` need the admin key in the `mol2-admin-key` header (forwarded by tritonserver as a request
parameter), paths stay inside the allowed roots, loads stay within the bounds, and every action is audited
(docs/admin.md)."""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend.adapters.admin_service import AdminPolicy, AdminService
from tritonserver_backend.auth import admin_auth as auth
from tritonserver_backend.triton import glue


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, registry = glue.setup(args)
        policy = AdminPolicy.from_params(params, lambda value: glue.resolve(args, value))
        self.service = AdminService(model_dir, registry, policy, log=auth.server_log)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                result = self.service.handle(glue.read(request, c.ACTION), glue.read(request, c.ADAPTER, ""),
                                             glue.read(request, c.ADAPTER_PATH, ""),
                                             glue.read(request, c.DESCRIPTION, ""),
                                             parameters=auth.request_parameters(request),
                                             request_id=auth.request_id(request))
                responses.append(glue.response({c.RESULT: result}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
