"""Structured outputs: a turn's grammar (JSON object, JSON schema, regex or EBNF) constrains what the decoder samples.

The grammar engine is xgrammar (the one vLLM, SGLang and TensorRT-LLM use). A request names its grammar as a small
JSON spec (the tensor API's `grammar` input, what the OpenAI frontend makes of `response_format` and vLLM's
`guided_*` / `structured_outputs`):

    {"type": "json_object"}                          any JSON object
    {"type": "json_schema", "schema": {...}}         JSON valid against the schema
    {"type": "regex", "pattern": "..."}              text matching the regular expression (all of it)
    {"type": "ebnf", "grammar": "root ::= ..."}      text of the grammar (xgrammar's EBNF, GBNF-style)
    {"type": "structural_tag", "format": {...}}      xgrammar's structural tag format: free text, constrained parts
                                                     (the frontend's tool_choice auto: a call, once begun, is valid)

JSON is generated without free whitespace (`{"a":1,"b":[2,3]}`): free whitespace lets a model pad forever, and a
small model does. `GrammarCache` compiles a spec once (keyed by its canonical JSON, bounded LRU); each turn with a
grammar gets its own matcher, and every decode step `allowed_tokens` fills one bitmask for all grammar rows of the
batch, which the sampler applies to the logits before it samples (greedy or not). The matcher allows end-of-turn
only where the grammar is complete, so a turn ends when its text does (or at max_tokens, unfinished).

This module imports xgrammar (and with it torch) only when a grammar is compiled: preprocess parses specs without it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

from tritonserver_backend.errors import BadRequest

KINDS = {"json_object": (), "json_schema": ("schema",), "regex": ("pattern",), "ebnf": ("grammar",),
         "structural_tag": ("format",)}
MAX_SPEC_CHARS = 64 * 1024
CACHE_SIZE = 64  # compiled grammars kept per process
JSON_SEPARATORS = (",", ":")
# json_object: xgrammar 0.2.8 writes {"type":"object"} with ", " between properties (and spaces inside nested values)
# whatever the separators. A compact object spelled out as a recursive schema was measured on the default (issue 50):
# it finished 5-70% of held-out json_object replies against 40-95% with xgrammar's own, so json_object keeps xgrammar's.
JSON_OBJECT_SCHEMA = '{"type":"object"}'


def canonical(text: str) -> str:
    """The tensor API's `grammar` input, checked and in canonical form (the spec's own keys sorted, no spaces): the
    cache key. "" (no grammar) stays "". Raises BadRequest for anything that is not one of the spec shapes (KINDS).

    A schema keeps its key order: the order of `properties` is the order the reply writes them in (as OpenAI's
    structured outputs do), so sorting them would reorder every client's object."""
    if not text:
        return ""
    if len(text) > MAX_SPEC_CHARS:
        raise BadRequest(f"grammar has {len(text)} characters, more than {MAX_SPEC_CHARS}")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"grammar is not valid JSON: {exc.msg}") from None
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise BadRequest('grammar must be a JSON object whose "type" is one of ' + ", ".join(KINDS))
    kind = spec["type"]
    extra = set(spec) - {"type", *KINDS[kind]}
    if extra:
        raise BadRequest(f"grammar of type {kind!r} takes no {', '.join(sorted(extra))}")
    for key in KINDS[kind]:
        value = spec.get(key)
        if key == "schema":
            if not isinstance(value, dict):
                raise BadRequest('a json_schema grammar needs "schema": a JSON schema object')
        elif key == "format":
            if not isinstance(value, dict):
                raise BadRequest('a structural_tag grammar needs "format": a structural tag format object '
                                 '(xgrammar\'s, e.g. {"type": "triggered_tags", ...})')
        elif not isinstance(value, str) or not value:
            raise BadRequest(f'a {kind} grammar needs "{key}": a non-empty string')
    return json.dumps({key: spec[key] for key in sorted(spec)}, separators=(",", ":"), ensure_ascii=False)


def _vocab_type(tokenizer_json: dict) -> str:
    """xgrammar's vocabulary type from a tokenizer.json's decoder: byte-level BPE (GPT-2 style, ours and DeepSeek's),
    SentencePiece-style byte fallback, or raw strings."""
    decoder = tokenizer_json.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])} if isinstance(decoder, dict) else set()
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK"
    return "RAW"


class GrammarCache:
    """Compiled grammars of one tokenizer, by canonical spec (least recently used dropped past `capacity`)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, capacity: int = CACHE_SIZE) -> None:
        """`tokenizer`: a ChatTokenizer (its `tok`, a tokenizers.Tokenizer, and end_of_turn_id); `vocab_size`: the
        model's logits width (default the tokenizer's vocabulary)."""
        self.tokenizer, self.capacity = tokenizer, capacity
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer.tok
            special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
            encoded = [""] * tok.get_vocab_size()
            for text, i in tok.get_vocab(with_added_tokens=True).items():
                encoded[i] = "" if i in special else text  # xgrammar never allows an empty token: control tokens
            vocab_type = getattr(xgr.VocabType, _vocab_type(json.loads(tok.to_str())))
            info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=self.vocab_size,
                                     stop_token_ids=[self.tokenizer.end_of_turn_id], add_prefix_space=False)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # our LRU is the cache
        return self._compiler

    def compile(self, spec: str) -> Any:
        """The compiled grammar of a canonical spec; BadRequest when it does not compile (bad schema, regex, EBNF)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                self.hits += 1
                return self._compiled[spec]
        data = json.loads(spec)
        compiler = self._get_compiler()
        kind = data["type"]
        try:
            if kind == "json_object":
                compiled = compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False,
                                                        separators=JSON_SEPARATORS)
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(json.dumps(data["schema"]), any_whitespace=False,
                                                        separators=JSON_SEPARATORS)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(json.dumps({"type": "structural_tag",
                                                                       "format": data["format"]}))
            elif kind == "regex":
                compiled = compiler.compile_regex(data["pattern"])
            else:
                compiled = compiler.compile_grammar(data["grammar"])
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise BadRequest(f"the {kind} grammar does not compile: {message}") from None
        with self._lock:
            self.misses += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: str) -> Any:
        """A fresh matcher (one turn's state in the grammar) of a canonical spec."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def __len__(self) -> int:
        return len(self._compiled)


def allowed_tokens(matchers: Sequence[Any], vocab_size: int) -> Any:
    """One batched bitmask for these matchers' next tokens, as a (len(matchers), vocab_size) bool tensor."""
    import numpy as np
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    # bit j of int32 word w is token 32 w + j: the words' little-endian bytes unpacked least significant bit first
    # (numpy: torch's shift-and-mask over (B, words, 32) went multi-threaded at 8 rows and took 50 ms on 2 busy cores)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.bool_))
