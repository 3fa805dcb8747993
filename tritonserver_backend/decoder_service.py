"""The decoder model's logic: apply ADAPTER_HASH, bounded replay, then the token loop.

Sessions here hold only the decoder side (`DecoderSession`): layer 20's global-KV mirror and the last W hand-over
rows, shared by every adapter, plus the rings of the adapter that answered last. Every turn replays the last W
rows under the adapter the router (or the client) chose; each generated token goes back through the encoder
(`encode` callback: a BLS call in Triton, a function call in-process) and its hand-over row comes back.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from build_engines.data.tokenizer import ChatTokenizer
from build_engines.formats.checkpoint import load_checkpoint
from build_engines.lora import Adapter, AdapterBank, AdapterError
from build_engines.model.conversation import DecoderSession
from build_engines.model.network import DecoderEngine
from build_engines.model.state import HandOver

from . import counters as k
from .counters import Counters
from .errors import BadRequest, ServingError, TurnRejected, UnknownAdapter
from .registry import BASE_NAME, Registry
from .sampling import Sampler, SamplingParams
from .session_store import SessionStore

EncodeFn = Callable[[str, np.ndarray], HandOver]
FINISH_EOT, FINISH_LENGTH, FINISH_STOP = "end_of_turn", "length", "stop"


class DecoderService:
    def __init__(self, model_dir: str | Path, registry: Registry, counters: Counters | None = None, budget_bytes: int = 2 << 30, max_context: int = 8192, replay_window: int | None = None) -> None:
        net = load_checkpoint(model_dir)
        self.cfg = net.cfg
        self.engine = DecoderEngine.from_state_dict(net.cfg, net.state_dict()).eval()
        del net
        self.tokenizer = ChatTokenizer.load(Path(model_dir))
        self.registry, self.counters = registry, counters or Counters()
        self.bank = AdapterBank(self.cfg, self.engine)
        self.bank.attach(self.engine)
        self._loaded: dict[str, tuple[str, int, int]] = {}  # name -> (path, mtime_ns, size) of the loaded version
        self._bank_lock = threading.Lock()
        self.max_context = max_context
        self.replay_window = replay_window or self.cfg.window_size
        self.sessions: SessionStore[DecoderSession] = SessionStore(budget_bytes, lambda s: s.nbytes())
        self._session_locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.sync_adapters()

    # ------------------------------------------------------------------ adapters
    def sync_adapters(self) -> None:
        """Bring the bank in line with the registry: load new or changed versions, unload removed ones.

        A request that already resolved its `Adapter` keeps it, so in-flight turns finish on their version.
        """
        with self._bank_lock:
            self.registry.refresh()
            wanted = {e.name: e for e in self.registry.entries()}
            for name in [n for n in self._loaded if n not in wanted]:
                self.bank.unload(name)
                del self._loaded[name]
            for name, entry in wanted.items():
                weights = self.registry.resolve_path(entry) / "adapter_model.safetensors"
                try:
                    st = weights.stat()
                except FileNotFoundError:
                    continue
                stamp = (entry.path, st.st_mtime_ns, st.st_size)
                if self._loaded.get(name) == stamp:
                    continue
                if name in self._loaded:
                    self.bank.unload(name)
                    del self._loaded[name]
                self.bank.load(self.registry.resolve_path(entry), name=name, path_id=entry.path)
                self._loaded[name] = stamp

    def resolve(self, adapter_hash: int) -> Adapter | None:
        self.sync_adapters()
        if adapter_hash == 0:
            return None
        try:
            return self.bank.get(int(adapter_hash))
        except AdapterError:
            raise UnknownAdapter(f"adapter hash {adapter_hash} is not loaded (unloaded meanwhile?); loaded adapters: {self.bank.names()}") from None

    # ------------------------------------------------------------------ sessions
    def _lock(self, session_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def end(self, session_id: str) -> None:
        self.sessions.end(session_id)
        with self._locks_lock:
            self._session_locks.pop(session_id, None)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, session_id: str, handover: HandOver, adapter_hash: int, params: SamplingParams, encode: EncodeFn) -> Iterator[tuple[int, str]]:
        """Yield (token, "") per generated token, then (-1, finish reason). Checks happen before any state moves.

        After the reply, its tokens and an end-of-turn token are in the history (encoded and absorbed), so the
        next user turn continues a well-formed conversation whatever stopped this one.
        """
        try:
            if handover.positions.numel() == 0:
                raise BadRequest("the hand-over has no rows")
            adapter = self.resolve(adapter_hash)
        except ServingError as exc:
            raise TurnRejected(str(exc)) from None
        name = BASE_NAME if adapter is None else adapter.name
        with self._lock(session_id):
            first = int(handover.positions[0])
            if first == 0:
                session = DecoderSession(self.engine, self.replay_window)
            else:
                try:
                    session = self.sessions.get(session_id)
                except ServingError as exc:
                    raise TurnRejected(str(exc)) from None
                if session.position != first:
                    raise TurnRejected(f"session {session_id!r}: the hand-over starts at position {first} but the decoder is at {session.position}")
            self.counters.add(k.READ, name)
            session.absorb(handover)
            out = session.replay(adapter)
            self.counters.add(k.APPLIED, name)
            self.counters.add(k.REPLAYS, name)
            self.counters.add(k.REPLAY_TOKENS, name, int(session.recent.positions.shape[0]) if session.recent is not None else 0)
            room = self.max_context - session.position - 2  # keep room for the last token and the end-of-turn
            limit = max(1, min(params.max_tokens, room))
            sampler = Sampler(params)
            generated: list[int] = []
            finish = FINISH_LENGTH
            eot = self.tokenizer.end_of_turn_id
            try:
                while True:
                    tok = sampler(out.logits[0, -1])
                    if tok == eot:
                        finish = FINISH_EOT
                        break
                    generated.append(tok)
                    yield tok, ""
                    if params.stop and any(s in self.tokenizer.decode(generated) for s in params.stop):
                        finish = FINISH_STOP
                        break
                    if len(generated) >= limit:
                        break
                    out = session.step(encode(session_id, np.asarray([tok], dtype=np.int64)))
            finally:
                trailing = [eot] if finish == FINISH_EOT or not generated else [generated[-1], eot]
                session.absorb(encode(session_id, np.asarray(trailing, dtype=np.int64)))
                self.sessions.put(session_id, session)
            yield -1, finish
