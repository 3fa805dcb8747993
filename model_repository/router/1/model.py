"""router: MoL2 pointer head on H19 over the loaded adapters; an explicit adapter always wins."""

import numpy as np
import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend import contract as c
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.router_service import UNLOADED, RouterService
from tritonserver_backend.errors import BadRequest, UnknownAdapter
from tritonserver_backend.triton import glue


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, registry = glue.setup(args)
        counters = Counters()
        glue.export_counters(counters, [k.WRITTEN, k.EXPLICIT])
        self.service = RouterService(model_dir, registry, counters, glue.engine(args, params, model_dir))

    def execute(self, requests):
        responses = []
        for request in requests:  # each request is a batch of rows; routed and explicit rows may be mixed
            try:
                h19 = glue.read(request, c.ROUTER_H19)
                explicit = glue.read(request, c.ROUTER_ADAPTER, None) or [""] * h19.shape[0]
                if len(explicit) != h19.shape[0]:
                    raise BadRequest(f"adapter has {len(explicit)} rows but H19 has {h19.shape[0]}")
                results = self.service.route(list(h19.astype(np.float32)), [e or None for e in explicit])
                # an explicit adapter unloaded since preprocess checked it: the decoder rejects the turn (and the
                # encoder rolls it back) instead of the ensemble failing after the turn was encoded
                results = [UNLOADED if isinstance(r, UnknownAdapter) else r for r in results]
                failed = next((r for r in results if isinstance(r, Exception)), None)
                if failed is not None:
                    raise failed
                responses.append(glue.response({c.ROUTER_ADAPTER_HASH: np.asarray(results, dtype=np.int32)}))
            except Exception as exc:  # noqa: BLE001
                responses.append(glue.error_response(exc))
        return responses
