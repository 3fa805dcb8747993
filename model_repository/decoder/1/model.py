"""decoder (decoupled): applies ADAPTER_HASH, bounded replay, then streams every active turn's tokens (text pieces) in
batched steps.

Every `pb_utils` call (inputs, responses, metrics, BLS) runs on one worker thread, except each step's BLS call to the
encoder, which runs on its own thread while responses stream: see turn_worker.py.
"""

import triton_python_backend_utils as pb_utils  # noqa: F401

from tritonserver_backend.auth.session_auth import InternalKey, internal_key_path
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.decoder_service import DecoderService
from tritonserver_backend.core.drafting import DRAFT_BATCH, make_drafter
from tritonserver_backend.core.scheduler import DEFAULT_REPLAY_BUDGET, TurnScheduler
from tritonserver_backend.core.text_service import TextService
from tritonserver_backend.core.turn_worker import TurnWorker
from tritonserver_backend.triton import decoder_dispatch as triton_decoder
from tritonserver_backend.triton import glue


class TritonPythonModel:
    def initialize(self, args):
        params, model_dir, registry = glue.setup(args)
        counters = Counters()
        glue.export_counters(counters, [k.READ, k.APPLIED, k.REJECTED, k.REPLAYS, k.REPLAY_TOKENS])
        glue.export_counters(counters, [k.DECODER_STEPS, k.DECODER_ROWS, k.REPLAY_PADDING], label="kind")
        text = TextService(model_dir)
        service = DecoderService(glue.engine(args, params, model_dir), registry, text.tokenizer, counters,
                                 int(params["session_budget_bytes"]), int(params["max_context"]))
        emitter = triton_decoder.Emitter(text, int(params.get("stream_interval", "1")), glue.LatencyHistograms())
        key = InternalKey.from_file(internal_key_path(glue.resolve(args, params["registry_root"]),
                                                      params.get("internal_key_file") or None))
        guard = triton_decoder.HandoverGuard(key)
        glue.export_counters(counters, [k.SPECULATIVE_BLOCKS, k.DRAFTED, k.DRAFTS_ACCEPTED])
        drafter = make_drafter(params.get("speculative", "auto"), int(params.get("speculative_block", "5")),
                               service.engine, float(params.get("speculative_confidence", "0")))
        scheduler = TurnScheduler(service, triton_decoder.BlsEncoderPort(key), emitter, triton_decoder.fail,
                                  int(params["max_active_turns"]), int(params.get("decode_lanes", "1")), drafter,
                                  int(params.get("speculative_batch", DRAFT_BATCH)),
                                  int(params.get("replay_tokens_per_step", DEFAULT_REPLAY_BUDGET)))
        self.scheduler = scheduler
        gauges = glue.SessionGauges("decoder", service.sessions)

        def iterate():
            scheduler.iterate()
            gauges.update()  # on the worker thread, which owns every pb_utils object of this stub

        self.worker = TurnWorker(lambda requests: triton_decoder.handle_requests(scheduler, guard, requests), iterate,
                                 lambda: scheduler.idle)

    def execute(self, requests):
        self.worker.submit(requests)  # the worker thread reads, runs and answers them; nothing else here
        return None

    def finalize(self):
        self.worker.stop()
        self.scheduler.close()
