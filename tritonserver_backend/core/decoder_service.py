"""The decoder model's logic: apply ADAPTER_HASH, bounded replay, then batched decode steps across sessions.

Sessions here hold only the decoder side (`DecoderRow`): layer 20's global-KV mirror and the last W hand-over rows,
shared by every adapter, plus the rings of the adapter that answered last. A turn (`begin`) absorbs its hand-over
and replays the last W rows under the chosen adapter (its own step, one row); afterwards every active turn advances
in one batched decoder step per token (`advance`), each row with its own adapter slot, position, rings and store
length. Rows of one batch never influence each other: the engine computes each row as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ced.lora import Adapter
from ced.model.network import CEDNetwork
from ced.steps.arena_pool import ArenaPool
from ced.steps.rows import HANDOVER_FIELDS, DecoderRow, absorb_decoder, decoder_inputs, replay_length
from tritonserver_backend.adapters.adapter_slots import AdapterSlots
from tritonserver_backend.adapters.registry import BASE_NAME, Registry
from tritonserver_backend.core import counters as k
from tritonserver_backend.core.counters import Counters
from tritonserver_backend.core.handover import MAX_DECODE_LANES, Handover
from tritonserver_backend.core.session_store import SessionStore
from tritonserver_backend.engines import StepEngine
from tritonserver_backend.errors import BadRequest, ServingError, TurnRejected
from tritonserver_backend.sampling.grammar import GrammarCache, allowed_tokens
from tritonserver_backend.sampling.sampler import Sampler, SamplingParams
from tritonserver_backend.sampling.speculative import accept_block

FINISH_EOT, FINISH_LENGTH, FINISH_STOP, FINISH_CANCELLED = "end_of_turn", "length", "stop", "cancelled"


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the position's most likely alternatives (`top_logprobs` of them)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """Log-softmax of the engine's logits in fp32 (the model's own distribution: penalties and temperature only shape
    what the sampler draws), read at `token` and at the `top` most likely ids (ties: the lower id first)."""
    lp = torch.log_softmax(torch.from_numpy(np.asarray(logits, np.float32)), dim=-1)
    if not top:
        return TokenLogprobs(float(lp[token]))
    order = np.lexsort((np.arange(lp.shape[0]), -lp.numpy()))[:top]
    return TokenLogprobs(float(lp[token]), tuple(int(i) for i in order), tuple(float(lp[i]) for i in order))


@dataclass
class DraftRing:
    """DSpark's input for one turn: the newest `window_size` `draft_main` rows (oldest first) and the position of the
    newest. Filled by the turn's replay, extended by every kept position, so it is always the rows of the positions
    the session holds, under the turn's adapter: a rejected draft's row never enters it."""

    rows: np.ndarray  # (count, dim)
    last_position: int

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def extend(self, rows: np.ndarray, last_position: int, window: int) -> None:
        self.rows = np.concatenate((self.rows, rows))[-window:]
        self.last_position = last_position


@dataclass
class SpeculativeBlock:
    """A speculative step of one turn, until its tokens are chosen: the drafts it verified, the target's logits after
    the fed token and after each draft, and what the decoder rows keep of it once the accepted length is known."""

    drafts: list[int]
    logits: np.ndarray  # (len(drafts) + 1, vocab)
    handover: Handover  # the step's hand-over rows (absorbed as a draft: `DecoderRow.absorb_draft`)
    ring_rows: np.ndarray  # (R, S, D) the step's decoder ring rows, written up to the kept length
    start: int  # the step's first position
    draft_main: np.ndarray | None = None  # (S, dim) the step's DSpark rows (engines with a drafter)


@dataclass
class Turn:
    """One turn being answered: its session's decoder row, adapter slot, sampler and what it generated so far."""

    session_id: str
    row: DecoderRow
    slot: int
    adapter: Adapter | None
    params: SamplingParams
    sampler: Sampler
    limit: int
    logits: np.ndarray | None = None  # next-token logits (vocab,)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # generated tokens the encoder has seen
    finish: str = ""
    end_session: bool = False
    context: object = None  # what the caller needs to answer (a response sender)
    unsent: list[int] = field(default_factory=list)  # sampled tokens not streamed yet (a stream interval above 1)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with params.logprobs: one per generated token
    matcher: object = None  # with params.grammar: the turn's state in its grammar (an xgrammar GrammarMatcher)
    allowed: torch.Tensor | None = None  # the grammar's allowed next tokens (vocab,) bool, filled each step
    block: "SpeculativeBlock | None" = None  # the speculative step whose tokens are not chosen yet (`choose_block`)
    keep: int = -1  # positions of the last speculative step to keep, for the encoder's next call (-1: none waiting)
    draft_ring: DraftRing | None = None  # DSpark's rows of this turn's context (engines with a drafter)
    turn_id: int = 0  # the encoder's lease of this turn (TurnStart.turn_id), named on every encoder call for it

    @property
    def drafts_allowed(self) -> bool:
        """Whether this turn's tokens may be drafted: not under a grammar (its mask follows every token), not while
        forced ids are emitted, not with logprobs, and not when the request opted out (`speculative` false)."""
        p = self.params
        return p.speculative and not p.grammar and not p.logprobs and len(self.generated) >= len(p.forced_ids)

    @property
    def adapter_name(self) -> str:
        return BASE_NAME if self.adapter is None else self.adapter.name

    def trailing(self, eot: int) -> list[int]:
        """What the encoder still has to see when the turn ends: the tokens not fed back yet (the last one, unless
        the client left after it was fed) and end-of-turn."""
        return self.generated[self.fed:] + [eot]


class DecoderService:
    def __init__(self, engine: StepEngine, registry: Registry, tokenizer, counters: Counters | None = None,  # type: ignore[no-untyped-def]
                 budget_bytes: int = 2 << 30, max_context: int = 8192) -> None:
        self.engine, self.layout, self.cfg = engine, engine.layout, engine.cfg
        self.tokenizer, self.registry = tokenizer, registry
        self.counters = counters or Counters()
        with torch.device("meta"):
            shapes_only = CEDNetwork(self.cfg)
        self.slots = AdapterSlots(engine, registry, shapes_only)
        self.max_context = max_context
        self.sessions: SessionStore[DecoderRow] = SessionStore(budget_bytes, lambda r: r.nbytes())
        self.busy: set[str] = set()
        self.arena = ArenaPool(MAX_DECODE_LANES)  # each decode lane's stacked rings and mirror, kept between its steps
        self.grammars = GrammarCache(tokenizer, self.cfg.vocab_size)  # compiled grammars by spec (grammar.py)

    # ------------------------------------------------------------------ a turn starts: absorb + bounded replay
    def prepare(self, session_id: str, handover: Handover, adapter_hash: int, params: SamplingParams,
                fork_from: str = "") -> Turn:
        """Check everything and absorb the turn's rows into a copy of the session (errors: TurnRejected, the encoder
        then rolls the turn back; the stored session is untouched either way). The replay comes next (`replay`).
        `fork_from`: a new session that starts as a copy of that stored session (contract.FORK_FROM)."""
        try:
            positions = handover["positions"]
            if positions.size == 0 and not fork_from:
                raise BadRequest("the hand-over has no rows")
            self._check_rows(handover)
            if session_id in self.busy:
                raise BadRequest(f"session {session_id!r} is still answering its previous turn")
            first = int(positions[0]) if positions.size else -1
            if fork_from:
                row = self._fork(fork_from, first)
            elif first == 0:
                row = DecoderRow.empty(self.layout)
            else:
                row = self.sessions.get(session_id).clone()
                if row.position != first:
                    raise BadRequest(f"session {session_id!r}: the hand-over starts at position {first} but the "
                                     f"decoder is at {row.position}")
            params.check_vocab(self.cfg.vocab_size)
            matcher = self.grammars.matcher(params.grammar) if params.grammar else None
            # room for the last token and end-of-turn
            limit = self._limit(params, self.max_context - row.position - int(positions.size) - 2)
            slot, adapter = self.slots.acquire(int(adapter_hash))
        except ServingError as exc:
            raise TurnRejected(str(exc)) from None
        if positions.size:
            row.absorb(self.layout, handover)
        self.busy.add(session_id)
        turn = Turn(session_id, row, slot, adapter, params, Sampler(params, self.tokenizer.end_of_turn_id), limit)
        turn.matcher = matcher
        return turn

    def _fork(self, source: str, first: int) -> DecoderRow:
        """A copy of `source`'s stored state (global-KV mirror, replay window): the start of a forked session."""
        if source in self.busy:
            raise BadRequest(f"session {source!r} is answering a turn; fork it once that turn has ended")
        row = self.sessions.get(source).clone()
        if first >= 0 and row.position != first:
            raise BadRequest(f"fork of {source!r}: the hand-over starts at position {first} but the source is at "
                             f"{row.position}")
        return row

    def _limit(self, params: SamplingParams, room: int) -> int:
        """Tokens the turn may emit: its forced ids, then max_tokens sampled ones (within the context); 0 = a turn that
        only encodes (prefill only: the session then holds the prompt up to the assistant prompt, no reply and no
        end-of-turn, ready to be forked, or continued by a raw turn)."""
        forced = params.forced_ids
        if forced and (len(forced) > room or max(forced) >= self.cfg.vocab_size):
            raise BadRequest(f"forced_ids: {len(forced)} ids must fit the context ({room} positions left) and the "
                             "vocabulary")
        if params.raw or params.max_tokens == 0:
            return min(len(forced) + params.max_tokens, room)
        return max(1, min(len(forced) + params.max_tokens, room))

    def replay(self, turns: list[Turn]) -> None:
        """Bounded replay of every starting turn in one batch: each row's last W rows under its adapter, rings
        afresh."""
        slots = [t.slot for t in turns]
        feed = decoder_inputs(self.layout, [t.row for t in turns], None, slots)
        out = self.engine.decoder(feed)
        absorb_decoder([t.row for t in turns], out, feed, True, slots)
        for b, turn in enumerate(turns):
            turn.logits = out["logits"][b]
            if "draft_main" in out:  # the replayed rows are the last ones of the step (padding comes first)
                count = min(turn.row.replay_count, self.cfg.window_size)
                turn.draft_ring = DraftRing(out["draft_main"][b, out["draft_main"].shape[1] - count:].copy(),
                                            turn.row.position - 1)

    def count(self, counter: str, adapter_hash: int) -> None:
        """A routing decision the decoder read (or rejected), labelled by the adapter's name."""
        self.registry.refresh()
        self.counters.add(counter, self.registry.name_of(int(adapter_hash)))

    def count_applied(self, turns: list[Turn]) -> None:
        """Counters of replayed turns. Separate from `replay`, which may run on the engine thread: counters become
        Triton metrics, and only the thread that owns `pb_utils` may touch those."""
        counts = [t.row.replay_count for t in turns]
        length = replay_length(counts, self.cfg.window_size)
        self.count_step(k.REPLAY, len(turns))
        self.counters.add(k.REPLAY_PADDING, k.REPLAY, sum(length - n for n in counts))
        for turn in turns:
            self.counters.add(k.APPLIED, turn.adapter_name)
            self.counters.add(k.REPLAYS, turn.adapter_name)
            self.counters.add(k.REPLAY_TOKENS, turn.adapter_name, turn.row.replay_count)

    def count_step(self, kind: str, rows: int) -> None:
        """One decoder engine call of `rows` sessions (on the thread that owns the metrics, like `count_applied`)."""
        self.counters.add(k.DECODER_STEPS, kind)
        self.counters.add(k.DECODER_ROWS, kind, rows)

    def _check_rows(self, handover: Handover) -> None:
        """Inner shapes against this model, positions consecutive: a malformed hand-over never reaches the engine."""
        cfg = self.cfg
        want = {"streams": (cfg.hc_mult, cfg.dim), "ffn_pre": (cfg.hc_mult,), "topk": (cfg.index_topk,),
                "candidates": (cfg.candidate_topk_blocks,), "global_kv": (cfg.head_dim,),
                "index_k": (cfg.index_head_dim,)}
        for key, inner in want.items():
            if handover[key].shape[1:] != inner:
                raise BadRequest(f"hand-over {key} has rows of shape {handover[key].shape[1:]}, this model needs "
                                 f"{inner}")
        positions = handover["positions"]
        if positions.size and (not np.array_equal(positions, np.arange(positions[0], positions[0] + positions.size))
                               or positions[0] < 0):
            raise BadRequest("hand-over positions must be consecutive and non-negative")

    # ------------------------------------------------------------------ sampling and stopping
    def constrain(self, turns: list[Turn]) -> None:
        """Before a step's tokens are chosen: one batched bitmask fill for every turn with a grammar."""
        grammar = [t for t in turns if t.matcher is not None and not t.finish]
        if not grammar:
            return
        masks = allowed_tokens([t.matcher for t in grammar], self.cfg.vocab_size)
        for turn, mask in zip(grammar, masks):
            turn.allowed = mask

    def choose(self, turn: Turn) -> int | None:
        """Sample the turn's next token; None when the turn ends here (end-of-turn or one of stop_token_ids sampled:
        neither is part of the reply)."""
        assert turn.logits is not None
        if len(turn.generated) < len(turn.params.forced_ids):
            return self._force(turn)
        if turn.matcher is not None and turn.allowed is None:  # a caller that skipped `constrain`
            self.constrain([turn])
        token = turn.sampler(torch.from_numpy(turn.logits), turn.generated, turn.allowed)
        turn.allowed = None
        if turn.matcher is not None and not turn.matcher.accept_token(token):  # type: ignore[attr-defined]
            raise ServingError(f"the grammar refused token {token}, which its own mask allowed")
        return self._take(turn, token)

    def _take(self, turn: Turn, token: int) -> int | None:
        """A chosen token (its logits in `turn.logits`): end the turn on end-of-turn or a stop id (None: neither is
        part of the reply), else add it to the reply and end the turn on a stop string or max_tokens."""
        if token == self.tokenizer.end_of_turn_id:
            turn.finish = FINISH_EOT
            return None
        if token in turn.params.stop_token_ids:
            turn.finish = FINISH_STOP
            return None
        turn.generated.append(token)
        if turn.params.logprobs:
            assert turn.logits is not None
            turn.logprobs.append(token_logprobs(turn.logits, token, turn.params.top_logprobs))
        if turn.params.stop and len(turn.generated) >= turn.params.min_tokens and any(
                s in self.tokenizer.decode(turn.generated) for s in turn.params.stop):
            turn.finish = FINISH_STOP
        elif len(turn.generated) >= turn.limit:
            turn.finish = FINISH_LENGTH
        return token

    def _force(self, turn: Turn) -> int:
        """Teacher forcing (contract.FORCED_IDS): the next forced id is emitted as if sampled, with its
        log-probability."""
        assert turn.logits is not None
        token = turn.params.forced_ids[len(turn.generated)]
        turn.generated.append(token)
        turn.allowed = None
        if turn.params.logprobs:
            turn.logprobs.append(token_logprobs(turn.logits, token, turn.params.top_logprobs))
        if len(turn.generated) >= turn.limit:
            turn.finish = FINISH_LENGTH
        return token

    # ------------------------------------------------------------------ batched decode
    def advance(self, turns: list[Turn], handovers: list[Handover], drafts: list[list[int]] | None = None) -> None:
        """One decoder step for every turn: absorb each one's new encoder rows, run all rows in one batch.

        `drafts` (speculative decoding): each turn fed its last token and these drafted tokens (as many for every
        turn, maybe none for one that does not draft). The step verifies them: it returns the logits after every
        position, and the rows keep nothing of the block until `choose_block` knows how much was accepted."""
        if drafts is None:
            for turn, h in zip(turns, handovers):
                turn.row.absorb(self.layout, h)
                turn.fed += h["positions"].shape[0]
        else:
            for turn, h in zip(turns, handovers):
                turn.row.absorb_draft(self.layout, h)
        slots = [t.slot for t in turns]
        steps = handovers[0]["positions"].shape[0]
        verify = None if drafts is None else np.tile(np.arange(steps - 1, dtype=np.int64), (len(turns), 1))
        feed = decoder_inputs(self.layout, [t.row for t in turns],
                              [{f: h[f] for f in HANDOVER_FIELDS} for h in handovers], slots, self.arena, verify=verify)
        out = self.engine.decoder(feed)
        draft_main = out.get("draft_main")
        if drafts is None:
            absorb_decoder([t.row for t in turns], out, feed, False, slots)
            for b, turn in enumerate(turns):
                turn.logits = out["logits"][b]
                if draft_main is not None and turn.draft_ring is not None:
                    turn.draft_ring.extend(draft_main[b], int(feed["start"][b]) + steps - 1, self.cfg.window_size)
            return
        for b, turn in enumerate(turns):
            logits = np.concatenate((out["verify_logits"][b], out["logits"][b][None]))
            turn.block = SpeculativeBlock(list(drafts[b]), logits, handovers[b], out["ring_rows"][b],
                                          int(feed["start"][b]), None if draft_main is None else draft_main[b])
            turn.logits = logits[0]

    def choose_block(self, turn: Turn) -> list[int]:
        """The tokens a turn emits after a speculative step (`advance` with drafts), then its rows settled.

        The drafts are checked by `speculative.accept_block` (greedy: the turn's own sampler at each position, so the
        reply is the plain reply token for token; temperature > 0: speculative sampling). Each token then goes
        through what `choose` does after sampling (end-of-turn, stop ids and strings, max_tokens), in order; the
        turn may end inside the block. The rows keep the fed token and the accepted drafts before the turn's end
        (`keep`), exactly as if only they had been stepped; the encoder is told at its next call (`Turn.keep`)."""
        block = turn.block
        assert block is not None
        if not block.drafts or not turn.drafts_allowed or turn.finish:
            token = None if turn.finish else self.choose(turn)
            self._settle_block(turn, 1)
            return [] if token is None else [token]
        proposal = accept_block(turn.sampler, torch.from_numpy(block.logits), block.drafts, turn.generated)
        emitted: list[int] = []
        for i, token in enumerate(proposal):
            turn.logits = block.logits[i]
            if self._take(turn, token) is None:
                break
            emitted.append(token)
            if turn.finish:
                break
        # the drafts among the emitted tokens (the last is the target's)
        accepted = min(len(emitted), len(proposal) - 1)
        self.counters.add(k.SPECULATIVE_BLOCKS, turn.adapter_name)
        self.counters.add(k.DRAFTED, turn.adapter_name, len(block.drafts))
        self.counters.add(k.DRAFTS_ACCEPTED, turn.adapter_name, accepted)
        self._settle_block(turn, 1 + accepted)
        return emitted

    def _settle_block(self, turn: Turn, keep: int) -> None:
        """Keep the first `keep` positions of the turn's speculative step in its decoder rows (mirror, replay window,
        rings) and remember the count for the encoder."""
        block = turn.block
        assert block is not None
        turn.row.settle(self.layout, block.handover, keep)
        absorb_decoder([turn.row], {"ring_rows": block.ring_rows[None]}, {"start": np.asarray([block.start])}, False,
                       [turn.slot], keep=[keep])
        if block.draft_main is not None and turn.draft_ring is not None:  # only kept positions' rows enter the ring
            turn.draft_ring.extend(block.draft_main[:keep], block.start + keep - 1, self.cfg.window_size)
        turn.fed += keep
        turn.keep, turn.block = keep, None

    def finish(self, turn: Turn, trailing: Handover) -> DecoderRow | None:
        """The turn is over: absorb its trailing rows (so the next turn continues a well-formed conversation) and
        store the session -> what was stored before (None: nothing), for `restore` should the encoder's commit
        fail."""
        turn.row.absorb(self.layout, trailing)
        previous = self.sessions.peek(turn.session_id)
        self.sessions.put(turn.session_id, turn.row)
        self.release(turn)
        return previous

    def restore(self, session_id: str, previous: DecoderRow | None) -> None:
        """Undo `finish`: the session as it was before the turn (the encoder rolled the turn back)."""
        if previous is None:
            self.sessions.end(session_id)
        else:
            self.sessions.put(session_id, previous)

    def release(self, turn: Turn) -> None:
        self.busy.discard(turn.session_id)
        self.slots.release(turn.slot)

    def end(self, session_id: str) -> None:
        self.sessions.end(session_id)
