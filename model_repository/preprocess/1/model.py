"""preprocess: user text -> the turn's token ids through the chat template (and history ids for a rebuild)."""

import time

import triton_python_backend_utils as pb_utils  # noqa: F401  (the stub provides it; glue uses it)

from tritonserver_backend import contract as c
from tritonserver_backend.core.text_service import TextService
from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.grammar import GrammarCache
from tritonserver_backend.triton import glue


class TritonPythonModel:
    def initialize(self, args):
        _, model_dir, self.registry = glue.setup(args)
        self.text = TextService(model_dir)
        self.grammars = GrammarCache(self.text.tokenizer)  # xgrammar is imported at the first grammar

    def execute(self, requests):
        arrival = time.time_ns()  # the turns' time-to-first-token starts here (the decoder observes it)
        responses = []
        for request in requests:
            try:
                # optional to Triton only so that their absence is answered
                for required in (c.SESSION_ID_IN, c.TEXT_IN):
                    if glue.read(request, required) is None:
                        raise BadRequest(f"missing required input {required.name!r}: every request to "
                                         f"{c.ENSEMBLE_NAME!r} carries {c.SESSION_ID.name!r} and {c.TEXT.name!r}")
                self.registry.check_explicit(glue.read(request, c.ADAPTER, ""))
                params = glue.sampling_params(request)  # bad sampling parameters fail here, before the turn is encoded
                params.check_vocab(self.text.tokenizer.vocab_size)
                if params.grammar:
                    self.grammars.compile(params.grammar)  # and a grammar that does not compile (cached by its spec)
                ids, prefix, start = self.text.render(glue.read(request, c.TEXT_IN),
                                                      bool(glue.read(request, c.NEW_SESSION, False)),
                                                      glue.read(request, c.HISTORY, None),
                                                      bool(glue.read(request, c.RAW, False)),
                                                      glue.read(request, c.FORK_FROM, None) is not None,
                                                      glue.read(request, c.TOOLS, None),
                                                      glue.read(request, c.TURN_MESSAGES, None))
                responses.append(glue.response({c.TOKEN_IDS: ids, c.PREFIX_IDS: prefix, c.START: start,
                                                c.ARRIVAL_NS: arrival}))
            except Exception as exc:  # noqa: BLE001 - one request's error never fails the others
                responses.append(glue.error_response(exc))
        return responses
