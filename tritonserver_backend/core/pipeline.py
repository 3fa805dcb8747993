"""The whole serving path in one process, on the same services and engine the Triton models use.

Used as the reference the Triton tests compare with (token for token), and by tools that want the serving
behaviour without a server. The order is the ensemble's: preprocess -> encoder -> router -> decoder (whose
scheduler calls the encoder per generated token and detokenizes). One engine serves all three services here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonserver_backend.adapters.registry import Registry
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.decoder_service import DecoderService, TokenLogprobs, Turn
from tritonserver_backend.core.drafting import Drafter
from tritonserver_backend.core.encoder_service import EncoderService
from tritonserver_backend.core.handover import Handover
from tritonserver_backend.core.router_service import RouterService
from tritonserver_backend.core.scheduler import TurnScheduler, TurnStart
from tritonserver_backend.core.session_journal import SessionJournal, model_digest
from tritonserver_backend.core.text_service import TextService
from tritonserver_backend.core.turn_lease import DEFAULT_LEASE_S
from tritonserver_backend.engines import open_engine
from tritonserver_backend.sampling.sampler import SamplingParams


@dataclass
class TurnResult:
    token_ids: list[int]
    text: str
    adapter: str
    finish_reason: str
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with params.logprobs: one per token id
    session_token: str = ""  # issued when this turn (re)started the session (later turns of it must present it)


class DirectEncoderPort:
    """The scheduler's encoder port as plain calls on an in-process EncoderService."""

    def __init__(self, encoder: EncoderService) -> None:
        self.encoder = encoder

    def step(self, session_ids: list[str], tokens: np.ndarray, turn_done: bool, keep: np.ndarray | None = None,
             draft: bool = False, turn_ids: np.ndarray | None = None) -> list[Handover]:
        return self.encoder.encode_step(session_ids, tokens, turn_done, keep, draft, turn_ids)

    def rollback(self, session_id: str, turn_id: int = 0) -> bool:
        return self.encoder.rollback(session_id, turn_id)

    def claim(self, session_id: str, turn_id: int) -> None:
        self.encoder.claim(session_id, turn_id)

    def drop(self, session_id: str) -> None:
        self.encoder.end(session_id)


class InProcessPipeline:
    def __init__(self, model_dir: str | Path, registry_root: str | Path, max_context: int = 8192,
                 backend: str = "torch", engine_dir: str | Path | None = None, session_auth: bool = False,
                 drafter: Drafter | None = None, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                 prefix_cache_bytes: int = 0, session_dir: str | Path | None = None) -> None:
        """`session_auth` off by default: the in-process pipeline has one caller (the server's models default to on).
        `drafter`: speculative decoding with it (None: plain decoding). `tensor_parallel_size` > 1: the encoder and
        the decoder each run on that many ranks (this process leads; `engines.rank_group`). `prefix_cache_bytes`: the
        encoder's prefix cache budget (0: off). `session_dir`: the session journal's folder (None: no journal); a
        pipeline opened later on the same folder resumes the sessions written there (session_journal.py)."""
        self.drafter = drafter
        self.counters = Counters()
        self.registry = Registry(registry_root)
        self.engine = open_engine(backend, model_dir, engine_dir, tensor_parallel_size, expert_parallel)
        self.text = TextService(model_dir)
        self.journal = (SessionJournal(session_dir, model_digest=model_digest(model_dir),
                                       vocab_size=self.engine.cfg.vocab_size) if session_dir is not None else None)
        self.encoder = EncoderService(self.engine, max_context=max_context, session_auth=session_auth,
                                      prefix_cache_bytes=prefix_cache_bytes, journal=self.journal,
                                      lease_s=DEFAULT_LEASE_S)
        self.router = RouterService(model_dir, Registry(registry_root), self.counters, self.engine)
        self.decoder = DecoderService(self.engine, Registry(registry_root), self.text.tokenizer, self.counters,
                                      max_context=max_context)

    def chat(self, session_id: str, text: str, adapter: str | None = None, new_session: bool = False,
             history: str | None = None, params: SamplingParams | None = None, end_session: bool = False,
             session_token: str | None = None,
             fork_from: str | None = None, fork_token: str | None = None,
             cache_salt: str | None = None, tools: str | None = None) -> TurnResult:
        """`params.raw` / `params.forced_ids`, `fork_from` / `fork_token`: the completions inputs (contract.RAW,
        ...); `tools`: the offered tools' JSON, rendered by the chat format (the tensor API's `tools`)."""
        params = params or SamplingParams()
        self.registry.check_explicit(adapter)  # fail before anything is encoded
        ids, prefix, start = self.text.render(text, new_session, history, params.raw, fork_from is not None,
                                              tools_json=tools)
        encoded = self.encoder.encode_turn(session_id, ids, prefix, start, session_token, fork_from, fork_token,
                                           cache_salt)
        routed = self.router.route([encoded.h19], [adapter])[0]
        if isinstance(routed, Exception):
            self.encoder.rollback(session_id, encoded.turn_id)
            raise routed
        result = self.answer(TurnStart(session_id, encoded.handover, int(routed), params, end_session,
                                       fork_from=fork_from or "", turn_id=encoded.turn_id))
        result.session_token = encoded.issued_token
        return result

    def end(self, session_id: str) -> None:
        """Drop an idle session on both sides (session_control's "end")."""
        self.decoder.end(session_id)
        self.encoder.end(session_id)

    def answer(self, request: TurnStart) -> TurnResult:
        """Run one turn through the decoder's scheduler alone (the path the server batches)."""
        tokens: list[int] = []
        finish: list[str] = []
        failure: list[BaseException] = []
        used: list[str] = []
        logprobs: list[TokenLogprobs] = []

        def emit(turn: Turn, token: int, reason: str) -> bool:
            used[:] = [turn.adapter_name]
            logprobs[:] = turn.logprobs
            if token >= 0:
                tokens.append(token)
            if reason:
                finish.append(reason)
            return True

        scheduler = TurnScheduler(self.decoder, DirectEncoderPort(self.encoder), emit,
                                  lambda _, exc: failure.append(exc), max_active=1, drafter=self.drafter)
        scheduler.submit(request)
        while not scheduler.idle:
            scheduler.iterate()
        if failure:
            raise failure[0]
        pieces = [self.text.piece(t) for t in tokens]
        adapter = used[0] if used else self.registry.name_of(request.adapter_hash)
        return TurnResult(tokens, self.text.decode(tokens), adapter, finish[0] if finish else "", pieces, logprobs)
