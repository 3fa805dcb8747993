"""The tensor contract of the model repository, defined once.

Every model's inputs and outputs, and the ensemble's wiring, are data here; `repository.py` renders the
`config.pbtxt` files from it and the `model.py` files read names from it, so names and dtypes cannot drift between
models. Client-facing tensors are lowercase, tensors between models UPPERCASE (the usual Triton convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton data type name without the TYPE_ prefix
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""

    def as_optional(self, doc: str | None = None) -> "TensorSpec":
        return TensorSpec(self.name, self.dtype, self.dims, True, self.doc if doc is None else doc)

    @property
    def numpy_dtype(self) -> type:
        return {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_,
                "BYTES": np.object_}[self.dtype]

    def pbtxt(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        opt = "\n    optional: true" if self.optional else ""
        config_type = "STRING" if self.dtype == "BYTES" else self.dtype  # model configs call BYTES "TYPE_STRING"
        return f'  {{\n    name: "{self.name}"\n    data_type: TYPE_{config_type}\n    dims: [ {dims} ]{opt}\n  }}'


# ------------------------------------------------------------------------------------ client-facing (ensemble)
SESSION_ID = TensorSpec("session_id", "BYTES", (1,), doc="conversation id; every request carries one")
TEXT = TensorSpec("text", "BYTES", (1,), doc="the user turn")
NEW_SESSION = TensorSpec("new_session", "BOOL", (1,), True, "true starts (or restarts) the session with this turn")
HISTORY = TensorSpec("history", "BYTES", (1,), True,
                     'JSON list of earlier {"role","content"} messages: rebuilds a lost or evicted session')
ADAPTER = TensorSpec("adapter", "BYTES", (1,), True,
                     'explicit adapter name (always wins over the router); "base" = no adapter; empty = route')
MAX_TOKENS = TensorSpec("max_tokens", "INT32", (1,), True,
                        "reply length limit (default 64); 0: prefill only (the turn is encoded and stored up to the "
                        "assistant prompt, nothing generated, no end-of-turn): a session to fork")
TEMPERATURE = TensorSpec("temperature", "FP32", (1,), True, "0 = greedy (default)")
TOP_P = TensorSpec("top_p", "FP32", (1,), True, "nucleus sampling mass (default 1.0)")
SEED = TensorSpec("seed", "INT64", (1,), True, "sampling seed (default 0): same seed, same reply")
STOP = TensorSpec("stop", "BYTES", (-1,), True, "stop strings; generation ends when the reply contains one")
FREQUENCY_PENALTY = TensorSpec("frequency_penalty", "FP32", (1,), True,
                               "[-2, 2]: subtracted from a token's logit once per time it appeared in the reply "
                               "(default 0)")
PRESENCE_PENALTY = TensorSpec("presence_penalty", "FP32", (1,), True,
                              "[-2, 2]: subtracted from the logit of a token that appeared in the reply (default 0)")
REPETITION_PENALTY = TensorSpec("repetition_penalty", "FP32", (1,), True,
                                "(0, 10]: divides a positive (multiplies a negative) logit of a token seen in the "
                                "reply (default 1)")
PENALTIES = (FREQUENCY_PENALTY, PRESENCE_PENALTY, REPETITION_PENALTY)
# sampling and structured outputs (issue 32)
TOP_K = TensorSpec("top_k", "INT32", (1,), True,
                   "sample among the k most likely tokens (default 0 = all; -1 = all too)")
MIN_P = TensorSpec("min_p", "FP32", (1,), True,
                   "[0, 1]: drop tokens less likely than min_p x the most likely one (default 0 = off)")
LOGIT_BIAS = TensorSpec("logit_bias", "BYTES", (1,), True,
                        'JSON object token id -> bias in [-100, 100], added to the logits before sampling (greedy '
                        'too), e.g. {"42": -100}')
STOP_TOKEN_IDS = TensorSpec("stop_token_ids", "INT32", (-1,), True,
                            'sampling one of these ids ends the turn with finish_reason "stop" (the id is not part of '
                            'the reply)')
MIN_TOKENS = TensorSpec("min_tokens", "INT32", (1,), True,
                        "0..max_tokens: end-of-turn and stop_token_ids are masked (and stop strings not checked) until "
                        "the reply has this many tokens (default 0)")
IGNORE_EOS = TensorSpec("ignore_eos", "BOOL", (1,), True,
                        "true: end-of-turn is never sampled; the reply runs to max_tokens, a stop string or a stop "
                        "token id")
GRAMMAR = TensorSpec("grammar", "BYTES", (1,), True,
                     'structured output, JSON: {"type":"json_object"} | {"type":"json_schema","schema":{...}} | '
                     '{"type":"regex","pattern":"..."} | {"type":"ebnf","grammar":"root ::= ..."} | '
                     '{"type":"structural_tag","format":{...}} (xgrammar\'s structural tag); the decoder samples '
                     'only tokens the grammar allows (xgrammar) and the reply ends where the grammar completes; one '
                     'that does not compile is refused. Not with ignore_eos or min_tokens')
SPECULATIVE = TensorSpec("speculative", "BOOL", (1,), True,
                         "false: this turn's tokens are never drafted, where the server decodes speculatively (the "
                         "reply is the same at temperature 0 either way)")
SAMPLING_INPUTS = (TOP_K, MIN_P, LOGIT_BIAS, STOP_TOKEN_IDS, MIN_TOKENS, IGNORE_EOS, GRAMMAR, SPECULATIVE)
SESSION_TOKEN = TensorSpec("session_token", "BYTES", (1,), True,
                           "the token issued when the session started (issued_session_token of its first reply): "
                           "needed by every later turn, end_session, cancel, and by new_session or history on a live "
                           "session (with session_auth on, the default)")
END_SESSION = TensorSpec("end_session", "BOOL", (1,), True, "true drops the session after this turn")
STREAM = TensorSpec("stream", "BOOL", (1,), True,
                    "false: the whole reply in one response (what Triton's HTTP /generate needs); default true: a "
                    "response per token")
LOGPROBS = TensorSpec("logprobs", "BOOL", (1,), True,
                      "true: each token's log-probability under the model (log-softmax of the engine's logits, before "
                      "penalties and temperature) comes back in token_logprob")
TOP_LOGPROBS = TensorSpec("top_logprobs", "INT32", (1,), True,
                          "0..20 (needs logprobs): the k most likely tokens at each position and their "
                          "log-probabilities (top_token_id, top_logprob)")

TEXT_OUTPUT = TensorSpec("text_output", "BYTES", (1,),
                         doc="one streamed piece of the reply (the text of this response's token ids)")
TOKEN_ID_OUT = TensorSpec("token_id", "INT32", (-1,),
                          doc="the streamed token ids, one per token of text_output (several with stream_interval > "
                              "1); [-1] on the final, empty response; with stream=false every id of the reply")
ADAPTER_NAME = TensorSpec("adapter_name", "BYTES", (1,), doc='adapter that produced the reply ("base" for none)')
FINISH_REASON = TensorSpec("finish_reason", "BYTES", (1,),
                           doc='"" while streaming; "stop", "length" or "end_of_turn" on the last response')
ISSUED_SESSION_TOKEN = TensorSpec("issued_session_token", "BYTES", (1,),
                                  doc="on every response of a turn that started (or rebuilt) the session: its new "
                                      "session_token, to send with each later request of the session; empty on "
                                      "continuing turns and with session_auth off. A streamed turn that starts a "
                                      "session sends it first in a response of its own (no token ids), so the turn can "
                                      "be cancelled while it waits")
TOKEN_LOGPROB_OUT = TensorSpec("token_logprob", "FP32", (-1,),
                               doc="with logprobs: one log-probability per id of token_id; empty without logprobs and "
                                   "on the final, empty response")
TOP_TOKEN_ID_OUT = TensorSpec("top_token_id", "INT32", (-1, -1),
                              doc="with top_logprobs k: (tokens, k) the most likely ids at each position, most likely "
                                  "first; (tokens, 0) without")
TOP_LOGPROB_OUT = TensorSpec("top_logprob", "FP32", (-1, -1),
                             doc="with top_logprobs k: (tokens, k) their log-probabilities")
LOGPROB_OUTPUTS = (TOKEN_LOGPROB_OUT, TOP_TOKEN_ID_OUT, TOP_LOGPROB_OUT)
# tools (issue 32): tool definitions and tool results, rendered by the model directory's chat format
TOOLS = TensorSpec("tools", "BYTES", (1,), True,
                   'JSON list of OpenAI tool definitions '
                   '({"type":"function","function":{"name","description","parameters"}}): the chat format renders them '
                   'into the prompt where it puts tools (the default: a system message after <|bos|>; deepseek-v4.1: '
                   'the first system turn); send the same list with every turn of a session')
TURN_MESSAGES = TensorSpec("turn_messages", "BYTES", (1,), True,
                           'JSON list of the messages this turn adds, instead of text\'s one user message (send text '
                           '""): tool results {"role":"tool","tool_call_id","content"} and user messages; earlier '
                           'assistant tool calls go in history as {"role":"assistant","content","tool_calls":[...]}')
TOOL_INPUTS = (TOOLS, TURN_MESSAGES)
# completions (issue 32): raw text, teacher forcing, forking a session after its prompt
RAW = TensorSpec("raw", "BOOL", (1,), True,
                 "true: text is plain text, tokenized as it is (no chat template, no assistant prompt, and no "
                 "end-of-turn appended after the reply): the completions API's sessions. A session it starts begins "
                 "with <|bos|>; with empty text, <|bos|> alone")
FORCED_IDS = TensorSpec("forced_ids", "INT32", (-1,), True,
                        "teacher forcing: the decoder emits exactly these token ids first (in token_id, with their "
                        "log-probabilities under the model when logprobs is on) instead of sampling them, then samples "
                        "up to max_tokens more (0 allowed)")
FORK_FROM = TensorSpec("fork_from", "BYTES", (1,), True,
                       "with new_session: the new session starts as a copy of this live, idle session (its encoder "
                       "state, its decoder's global-KV mirror and replay window); nothing is re-encoded, text may be "
                       "empty; needs that session's token in fork_token")
FORK_TOKEN = TensorSpec("fork_token", "BYTES", (1,), True, "the session token of the fork_from session")
CACHE_SALT = TensorSpec("cache_salt", "BYTES", (1,), True,
                        "the prefix cache partition a starting session reads and fills (at most 256 printable "
                        "characters; absent: the shared partition): sessions with another salt never see its "
                        "prefixes, nor their timing")
COMPLETION_INPUTS = (RAW, FORCED_IDS, FORK_FROM, FORK_TOKEN)
CACHE_INPUTS = (CACHE_SALT,)

# ------------------------------------------------------------------------------------ between models
TOKEN_IDS = TensorSpec("TOKEN_IDS", "INT64", (-1,),
                       doc="the user turn rendered by the chat template (ends with the assistant prompt); H19 is "
                           "pooled over it")
PREFIX_IDS = TensorSpec("PREFIX_IDS", "INT64", (-1,),
                        doc="what precedes TOKEN_IDS when a session (re)starts: <|bos|> and any history turns")
START = TensorSpec("START", "BOOL", (1,), doc="the client asked for a new session")
ISSUED_TOKEN = TensorSpec("ISSUED_TOKEN", "BYTES", (1,),
                          doc="the session token the encoder issued for a turn that (re)started the session, else "
                              "empty")
GRANT = TensorSpec("GRANT", "BYTES", (1,),
                   doc="the encoder's signature on a turn's hand-over (HMAC under the server's internal key of the "
                       "session, the first position and when it was issued, which is the turn's id): the decoder "
                       "takes hand-over rows only with a fresh one, newer than the session's last")
INTERNAL_KEY = TensorSpec("INTERNAL_KEY", "BYTES", (1,), True,
                          "the server's internal key, sent by its own models (BLS): with STEP_*, ROLLBACK, "
                          "CLAIM_TURN and DROP_SESSION to the encoder, with CONTROL to the decoder; a client calling "
                          "those models directly cannot step, roll back, drop or cancel a session")
CHECK_TOKEN = TensorSpec("CHECK_TOKEN", "BOOL", (1,), True,
                         "sent by session_control (BLS) with session_id and session_token: answer whether the token "
                         "opens the live session (refusals counted as path=cancel)")
ARRIVAL_NS = TensorSpec("ARRIVAL_NS", "INT64", (1,),
                        doc="when preprocess took the turn (ns since the epoch): the decoder's time-to-first-token "
                            "starts here")
ROLLBACK = TensorSpec("ROLLBACK", "BOOL", (1,), True,
                      "sent by the decoder (BLS) when it rejects a turn: undo the turn's encoding")
DROP_SESSION = TensorSpec("DROP_SESSION", "BOOL", (1,), True,
                          "sent by the decoder (BLS) after a turn with end_session: drop the encoder state")
STEP_SESSION_IDS = TensorSpec("STEP_SESSION_IDS", "BYTES", (-1,), True,
                              "sent by the decoder (BLS): the sessions of one batched step")
STEP_TOKEN_IDS = TensorSpec("STEP_TOKEN_IDS", "INT64", (-1, -1), True,
                            "(B, S) each step session's next tokens; hand-over rows come back session after session")
STEP_KEEP = TensorSpec("STEP_KEEP", "INT64", (-1,), True,
                       "with STEP_*: per step session, the positions of its previous (speculative) step to keep, 1..S "
                       "(the fed token and the accepted drafts); -1: none waiting")
STEP_DRAFT = TensorSpec("STEP_DRAFT", "BOOL", (1,), True,
                        "with STEP_*: a speculative step; its rows are absorbed at the next call, up to that call's "
                        "STEP_KEEP")
TURN_DONE = TensorSpec("TURN_DONE", "BOOL", (1,), True,
                       "with STEP_*: commit these sessions' turns (their journal records are written and their next "
                       "user turn is welcome); the decoder sends it with no tokens once it has stored its own side")
STEP_TURN_IDS = TensorSpec("STEP_TURN_IDS", "INT64", (-1,), True,
                           "sent by the decoder (BLS) with STEP_*, ROLLBACK or CLAIM_TURN: each session's turn id "
                           "(its grant's issue time); a call naming a turn no longer in flight is refused (a step) "
                           "or changes nothing (a rollback)")
CLAIM_TURN = TensorSpec("CLAIM_TURN", "BOOL", (1,), True,
                        "sent by the decoder (BLS) when it takes a turn (SESSION_ID, STEP_TURN_IDS): the turn's "
                        "lease no longer expires; refused when the lease already ended")
H19 = TensorSpec("H19", "FP32", (1, -1),
                 doc="last encoder layer's streams, mean over hc streams and the user turn: (1, dim)")
ROUTER_H19 = TensorSpec("H19", "FP32", (-1, -1), doc="(B, dim): the router scores a batch of rows in one call")
ROUTER_ADAPTER = TensorSpec("adapter", "BYTES", (-1,), True, "(B,) explicit adapter per row; empty = route that row")
ROUTER_ADAPTER_HASH = TensorSpec("ADAPTER_HASH", "INT32", (-1,),
                                 doc="(B,) one decision per row; -1 where the explicit adapter is not loaded")
ADAPTER_HASH = TensorSpec("ADAPTER_HASH", "INT32", (1,),
                          doc="31-bit FNV-1a of the adapter path; 0 = base; -1 = the explicit adapter is not loaded")

CONTROL = TensorSpec("CONTROL", "BYTES", (1,), True,
                     'sent by session_control (BLS): "cancel" ends the session\'s turn in flight (the other inputs are '
                     'left out)')
HANDOVER_POSITIONS = TensorSpec("HANDOVER_POSITIONS", "INT64", (-1,), doc="(S,) absolute positions")
HANDOVER_STREAMS = TensorSpec("HANDOVER_STREAMS", "FP32", (-1, -1, -1),
                              doc="(S, hc, dim) streams after layer 20's attention")
HANDOVER_FFN_PRE = TensorSpec("HANDOVER_FFN_PRE", "FP32", (-1, -1), doc="(S, hc) layer 20's pre mix into its FFN")
HANDOVER_TOPK = TensorSpec("HANDOVER_TOPK", "INT64", (-1, -1), doc="(S, index_topk) layer 20's top-k, -1 padded")
HANDOVER_CANDIDATES = TensorSpec("HANDOVER_CANDIDATES", "INT64", (-1, -1),
                                 doc="(S, candidate_blocks) layer 20's pool, -1 padded")
HANDOVER_GLOBAL_KV = TensorSpec("HANDOVER_GLOBAL_KV", "FP32", (-1, -1), doc="(S, D) layer 20's new global-KV entries")
HANDOVER_INDEX_K = TensorSpec("HANDOVER_INDEX_K", "FP32", (-1, -1), doc="(S, Di) layer 20's new index keys")
HANDOVER = (HANDOVER_POSITIONS, HANDOVER_STREAMS, HANDOVER_FFN_PRE, HANDOVER_TOPK, HANDOVER_CANDIDATES,
            HANDOVER_GLOBAL_KV, HANDOVER_INDEX_K)

# ------------------------------------------------------------------------------------ admin
ACTION = TensorSpec("action", "BYTES", (1,), doc="load | unload | list")
CONTROL_ACTION = TensorSpec("action", "BYTES", (1,),
                            doc='"cancel": stop the session\'s turn in flight (its partial reply stays in the '
                                'history); "end": drop an idle session on both sides')
CONTROL_TOKEN = SESSION_TOKEN.as_optional("the session's session_token (needed with session_auth on)")
ADAPTER_PATH = TensorSpec("path", "BYTES", (1,), True,
                          "adapter directory (PEFT layout) for load; a new version of a loaded path updates it")
DESCRIPTION = TensorSpec("description", "BYTES", (1,), True, "what the router reads about the adapter")
RESULT = TensorSpec("result", "BYTES", (1,), doc="JSON answer")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = False
    max_batch_size: int = 0


# Triton 2.51 checks an ensemble request's required inputs only when fewer than their number arrive: a request
# without session_id (or text) but with some optional input passed that check, the step needing it never ran and the
# client got no response at all (HTTP /generate: "expected exactly 1 response"). So the ensemble declares both
# optional and preprocess, its first step, refuses a request without them with a clear error.
SESSION_ID_IN = SESSION_ID.as_optional("conversation id: required; declared optional to Triton so that preprocess can "
                                       "answer its absence")
TEXT_IN = TEXT.as_optional("the user turn: required; declared optional to Triton so that preprocess can answer its "
                           "absence")
PREPROCESS = ModelSpec("preprocess", (SESSION_ID_IN, TEXT_IN, NEW_SESSION, HISTORY, *TOOL_INPUTS, ADAPTER, MAX_TOKENS,
                                      TEMPERATURE, TOP_P, SEED, STOP, *PENALTIES, *SAMPLING_INPUTS, LOGPROBS,
                                      TOP_LOGPROBS, RAW, FORCED_IDS, FORK_FROM),
                       (TOKEN_IDS, PREFIX_IDS, START, ARRIVAL_NS))
ENCODER = ModelSpec("encoder", (SESSION_ID, TOKEN_IDS, PREFIX_IDS, START, SESSION_TOKEN, DROP_SESSION, ROLLBACK,
                                STEP_SESSION_IDS, STEP_TOKEN_IDS, STEP_KEEP, STEP_DRAFT, TURN_DONE, STEP_TURN_IDS,
                                CLAIM_TURN, INTERNAL_KEY, CHECK_TOKEN, FORK_FROM, FORK_TOKEN, CACHE_SALT),
                    (H19, *HANDOVER, ISSUED_TOKEN, GRANT))
ROUTER = ModelSpec("router", (ROUTER_H19, ROUTER_ADAPTER), (ROUTER_ADAPTER_HASH,))
# the decoder detokenizes and names the adapter itself: a separate postprocess model cost one more model call (two
# more IPC round trips) per streamed token per session, the largest per-token cost of the batched path (docs/load.md)
DECODER = ModelSpec(
    "decoder",
    (SESSION_ID, ADAPTER_HASH.as_optional(), *(h.as_optional() for h in HANDOVER), MAX_TOKENS, TEMPERATURE, TOP_P, SEED,
     STOP, *PENALTIES, *SAMPLING_INPUTS, END_SESSION, STREAM,
     LOGPROBS, TOP_LOGPROBS, CONTROL, ARRIVAL_NS.as_optional(), ISSUED_TOKEN.as_optional(), GRANT.as_optional(),
     INTERNAL_KEY, RAW, FORCED_IDS, FORK_FROM),
    (TEXT_OUTPUT, TOKEN_ID_OUT, ADAPTER_NAME, FINISH_REASON, *LOGPROB_OUTPUTS, ISSUED_SESSION_TOKEN),
    decoupled=True,
)
ADMIN = ModelSpec("adapter_admin", (ACTION, ADAPTER_PATH, ADAPTER, DESCRIPTION), (RESULT,))
SESSION_CONTROL = ModelSpec("session_control", (SESSION_ID, CONTROL_ACTION, CONTROL_TOKEN), (RESULT,))
ENSEMBLE_NAME = "mol2"
ENSEMBLE_INPUTS = (SESSION_ID_IN, TEXT_IN, NEW_SESSION, HISTORY, *TOOL_INPUTS, ADAPTER, MAX_TOKENS, TEMPERATURE, TOP_P,
                   SEED, STOP, *PENALTIES, *SAMPLING_INPUTS, END_SESSION, STREAM,
                   LOGPROBS, TOP_LOGPROBS, SESSION_TOKEN, *COMPLETION_INPUTS, *CACHE_INPUTS)
ENSEMBLE_OUTPUTS = (TEXT_OUTPUT, TOKEN_ID_OUT, ADAPTER_NAME, FINISH_REASON, *LOGPROB_OUTPUTS, ISSUED_SESSION_TOKEN)
MODELS = (PREPROCESS, ENCODER, ROUTER, DECODER, ADMIN, SESSION_CONTROL)


def ensemble_steps() -> list[tuple[ModelSpec, dict[str, str], dict[str, str]]]:
    """(model, input map model-tensor -> ensemble-tensor, output map) for each step, in order.

    Ensemble tensor names equal the model tensor names, so the maps are identities over each model's I/O.
    """
    steps = []
    available = {t.name for t in ENSEMBLE_INPUTS}
    for model in (PREPROCESS, ENCODER, ROUTER, DECODER):
        # inputs nobody in the ensemble produces (e.g. DROP_SESSION, sent only by the decoder's BLS) stay unmapped
        steps.append((model, {t.name: t.name for t in model.inputs if t.name in available},
                      {t.name: t.name for t in model.outputs}))
        available |= {t.name for t in model.outputs}
    return steps
