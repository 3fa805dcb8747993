"""The encoder model's logic: per-session encoder state, run once per token for every adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from build_engines.formats.checkpoint import load_checkpoint
from build_engines.model.network import EncoderEngine
from build_engines.model.state import HandOver, SessionState
from build_engines.routing.pointer_head import pool_h19

from .errors import BadRequest
from .session_store import SessionStore

DEFAULT_MAX_CONTEXT = 8192


class EncoderService:
    def __init__(self, model_dir: str | Path, budget_bytes: int = 2 << 30, max_context: int = DEFAULT_MAX_CONTEXT) -> None:
        net = load_checkpoint(model_dir)
        self.cfg = net.cfg
        self.engine = EncoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
        del net
        self.max_context = max_context
        self.sessions: SessionStore[SessionState] = SessionStore(budget_bytes, lambda s: s.nbytes())
        self._turn_start: dict[str, SessionState | None] = {}  # state before the turn in flight (None: it started the session)

    @torch.no_grad()
    def encode(self, session_id: str, token_ids: np.ndarray, prefix_ids: np.ndarray | None = None, start: bool = False) -> tuple[np.ndarray, HandOver]:
        """Encode a turn (or generated tokens) for a session -> (H19 pooled over `token_ids`, hand-over rows).

        A session starts when `start` is set, or is rebuilt when it is unknown and `prefix_ids` carries history
        (more than the lone <|bos|>); otherwise an unknown session is an error. Nothing is stored on error.
        """
        if not session_id:
            raise BadRequest("session_id must be a non-empty string")
        ids = _check_ids(token_ids, self.cfg.vocab_size, "TOKEN_IDS")
        prefix = _check_ids(prefix_ids, self.cfg.vocab_size, "PREFIX_IDS") if prefix_ids is not None else np.zeros(0, np.int64)
        if ids.size == 0:
            raise BadRequest("TOKEN_IDS is empty")
        existed = self.sessions.contains(session_id)
        if start or (not existed and prefix.size > 1):
            state, ids_all = self.engine.new_state(), np.concatenate([prefix, ids])
        else:
            state, ids_all = self.sessions.get(session_id), ids
        if state.position + ids_all.size > self.max_context:
            raise BadRequest(f"session {session_id!r} would reach {state.position + ids_all.size} tokens, more than the {self.max_context}-token context limit")
        tokens = torch.from_numpy(ids_all).unsqueeze(0)
        handover, new_state = self.engine(tokens, state)
        if prefix.size:  # a user turn (the ensemble always sends a prefix): remember where it started
            self._turn_start[session_id] = self.sessions.get(session_id) if existed else None
        else:  # generated tokens: the decoder accepted the turn
            self._turn_start.pop(session_id, None)
        self.sessions.put(session_id, new_state)
        h19 = pool_h19(handover.encoder_out[:, -ids.size :])[0]
        return h19.numpy().astype(np.float32), handover

    def rollback(self, session_id: str) -> None:
        """Undo the last user turn's encoding (the decoder rejected the turn before absorbing it)."""
        if session_id not in self._turn_start:
            return
        before = self._turn_start.pop(session_id)
        if before is None:
            self.sessions.end(session_id)
        else:
            self.sessions.put(session_id, before)

    def end(self, session_id: str) -> bool:
        self._turn_start.pop(session_id, None)
        return self.sessions.end(session_id)


def _check_ids(ids: np.ndarray, vocab: int, name: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadRequest(f"{name} must be a 1-D integer tensor, got shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise BadRequest(f"{name} holds ids outside [0, {vocab})")
    return a.astype(np.int64)
