"""decoder (decoupled): applies ADAPTER_HASH, bounded replay, then streams tokens, calling the encoder per token.

Every `pb_utils` call (inputs, BLS, responses, metrics) runs on one worker thread: see turn_worker.py.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonserver_backend import contract as c
from tritonserver_backend import counters as k
from tritonserver_backend import triton_glue as glue
from tritonserver_backend.counters import Counters
from tritonserver_backend.decoder_service import DecoderService
from tritonserver_backend.errors import TurnRejected
from tritonserver_backend.handover_codec import from_arrays
from tritonserver_backend.turn_worker import TurnWorker

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, registry = glue.setup(args)
        counters = Counters()
        glue.export_counters(counters, [k.READ, k.APPLIED, k.REPLAYS, k.REPLAY_TOKENS])
        self.service = DecoderService(model_dir, registry, counters, int(params["session_budget_bytes"]), int(params["max_context"]))
        self.worker = TurnWorker(self._serve)

    def execute(self, requests):
        self.worker.submit(requests)  # the worker thread reads, runs and answers them; nothing else here
        return None

    def _encode(self, session_id, ids):
        out = glue.bls("encoder", {c.SESSION_ID: session_id, c.TOKEN_IDS: ids, c.PREFIX_IDS: np.zeros(0, np.int64), c.START: False}, list(c.HANDOVER))
        return from_arrays(out)

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            session = glue.read(request, c.SESSION_ID)
            adapter_hash = int(glue.read(request, c.ADAPTER_HASH))
            handover = from_arrays({spec.name: glue.read(request, spec) for spec in c.HANDOVER})
            params = glue.sampling_params(request)
            for token, finish in self.service.generate(session, handover, adapter_hash, params, self._encode):
                outputs = {c.TOKEN_ID: token, c.ADAPTER_HASH_APPLIED: adapter_hash, c.FINISH: finish}
                sender.send(glue.response(outputs), flags=FINAL if token < 0 else 0)
            if glue.read(request, c.END_SESSION, False):
                self.service.end(session)
                glue.bls("encoder", {c.SESSION_ID: session, c.TOKEN_IDS: np.zeros(0, np.int64), c.PREFIX_IDS: np.zeros(0, np.int64), c.START: False, c.DROP_SESSION: True}, [])
        except TurnRejected as exc:  # nothing was absorbed: undo the turn's encoding so the session loses nothing
            glue.bls("encoder", {c.SESSION_ID: session, c.TOKEN_IDS: np.zeros(0, np.int64), c.PREFIX_IDS: np.zeros(0, np.int64), c.START: False, c.ROLLBACK: True}, [])
            sender.send(glue.error_response(exc), flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - this request fails alone; other sessions go on
            sender.send(glue.error_response(exc), flags=FINAL)

    def finalize(self):
        self.worker.stop()
