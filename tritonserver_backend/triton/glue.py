"""The only place that talks to Triton's Python backend (`triton_python_backend_utils`).

`model.py` files call these helpers, so they stay a screen long: read inputs by the contract (with defaults for
optional ones), build responses, turn a `ServingError` into a short per-request error (tracebacks go to the
server log only), call the encoder through BLS, and export the counters as Triton custom metrics.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tritonserver_backend import contract as c
from tritonserver_backend.core.counters import DESCRIPTIONS, Counters
from tritonserver_backend.errors import BadRequest, ServerBusy, ServingError

if TYPE_CHECKING:
    from tritonserver_backend.adapters.registry import Registry
    from tritonserver_backend.auth.session_auth import InternalKey
    from tritonserver_backend.core.session_journal import SessionJournal
    from tritonserver_backend.sampling.params import SamplingParams

LOG = logging.getLogger("mol2")


def pb():  # type: ignore[no-untyped-def]
    import triton_python_backend_utils as pb_utils  # only importable inside the Python-backend stub

    return pb_utils


# ---------------------------------------------------------------------------------------------- configuration
def parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def resolve(args: dict, value: str) -> Path:
    """Paths in config parameters are relative to the model repository's parent (the project root)."""
    p = Path(os.path.expandvars(value))
    return p if p.is_absolute() else (Path(args["model_repository"]).resolve().parent.parent / p).resolve()


def setup(args: dict) -> tuple[dict[str, str], Path, "Registry | None"]:
    """What every model's initialize needs: its parameters, torch threads, the model folder, the adapter registry."""
    from tritonserver_backend.adapters.registry_init import ensure_registry

    params = parameters(args)
    set_threads(params)
    model_dir = resolve(args, params["model_dir"])
    registry_root = params.get("registry_root")
    return params, model_dir, ensure_registry(resolve(args, registry_root), model_dir) if registry_root else None


def set_threads(params: dict[str, str]) -> None:
    """CPU threads of this stub's math: torch reads OMP_NUM_THREADS when it starts, so the stubs that never import
    torch (preprocess, encoder and session_control on compiled engines) do not pay for importing it here."""
    threads = params.get("torch_threads", "1")
    os.environ["OMP_NUM_THREADS"] = threads
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def engine(args: dict, params: dict[str, str], model_dir: Path):  # type: ignore[no-untyped-def]
    """The model's engine, from its `engine_backend` / `engine_dir` parameters (paths relative to the project root)."""
    from tritonserver_backend.engines import open_engine

    backend = params.get("engine_backend", "torch")
    engine_dir = resolve(args, params["engine_dir"]) if params.get("engine_dir") else None
    os.environ.setdefault("MOL2_ORT_THREADS", params.get("torch_threads", "1"))
    opened = open_engine(backend, model_dir, engine_dir, int(params.get("tensor_parallel_size", "1")),
                         params.get("enable_expert_parallel", "false") == "true", int(params.get("torch_threads", "1")))
    LOG.info("engine: %s", opened.describe())
    return opened


# ---------------------------------------------------------------------------------------------- inputs
def read(request: Any, spec: c.TensorSpec, default: Any = None) -> Any:
    """One input as numpy (BYTES decoded to str for [1]-shaped tensors); `default` when optional and absent."""
    t = pb().get_input_tensor_by_name(request, spec.name)
    if t is None:
        if spec.optional:
            return default
        raise BadRequest(f"missing input {spec.name}")
    a = t.as_numpy()
    want = spec.numpy_dtype
    if spec.dtype == "BYTES":
        if a.dtype != np.object_:
            raise BadRequest(f"input {spec.name} must be BYTES")
        flat = a.reshape(-1)
        decoded = [v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v) for v in flat]
        if spec.dims == (1,):
            if len(decoded) != 1:
                raise BadRequest(f"input {spec.name} must hold exactly one string, got {len(decoded)}")
            return decoded[0]
        return decoded
    if a.dtype != want:
        raise BadRequest(f"input {spec.name} must be {spec.dtype}, got {a.dtype}")
    if spec.dims == (1,):
        if a.size != 1:
            raise BadRequest(f"input {spec.name} must hold exactly one value, got shape {a.shape}")
        return a.reshape(-1)[0].item()
    if len(spec.dims) != a.ndim:
        raise BadRequest(f"input {spec.name} must have rank {len(spec.dims)}, got shape {a.shape}")
    return a


def sampling_params(request: Any) -> "SamplingParams":
    """The request's sampling inputs with their defaults (validated: a bad value is a BadRequest)."""
    from tritonserver_backend.sampling.grammar import canonical
    from tritonserver_backend.sampling.params import DEFAULT_MAX_TOKENS, SamplingParams, parse_logit_bias

    return SamplingParams(
        max_tokens=int(read(request, c.MAX_TOKENS, DEFAULT_MAX_TOKENS)),
        temperature=float(read(request, c.TEMPERATURE, 0.0)),
        top_p=float(read(request, c.TOP_P, 1.0)),
        seed=int(read(request, c.SEED, 0)),
        stop=tuple(read(request, c.STOP, [])),
        frequency_penalty=float(read(request, c.FREQUENCY_PENALTY, 0.0)),
        presence_penalty=float(read(request, c.PRESENCE_PENALTY, 0.0)),
        repetition_penalty=float(read(request, c.REPETITION_PENALTY, 1.0)),
        logprobs=bool(read(request, c.LOGPROBS, False)),
        top_logprobs=int(read(request, c.TOP_LOGPROBS, 0)),
        top_k=int(read(request, c.TOP_K, 0)),
        min_p=float(read(request, c.MIN_P, 0.0)),
        logit_bias=parse_logit_bias(read(request, c.LOGIT_BIAS, "")),
        stop_token_ids=tuple(int(t) for t in
                             np.asarray(read(request, c.STOP_TOKEN_IDS, np.zeros(0, np.int32))).reshape(-1)),
        min_tokens=int(read(request, c.MIN_TOKENS, 0)),
        ignore_eos=bool(read(request, c.IGNORE_EOS, False)),
        grammar=canonical(read(request, c.GRAMMAR, "")),
        speculative=bool(read(request, c.SPECULATIVE, True)),
        raw=bool(read(request, c.RAW, False)),
        forced_ids=tuple(int(t) for t in read(request, c.FORCED_IDS, np.zeros(0, np.int32)).reshape(-1)),
    )


def tensor(spec: c.TensorSpec, value: Any) -> Any:
    if spec.dtype == "BYTES":
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v
                        for v in (value if isinstance(value, list) else [value])], dtype=np.object_)
    else:
        arr = np.asarray(value, dtype=spec.numpy_dtype)
        if len(spec.dims) == 1:  # a scalar or a list for a 1-D output ([1] or [-1])
            arr = arr.reshape(-1)
    return pb().Tensor(spec.name, arr)


def by_spec(specs: tuple[c.TensorSpec, ...], arrays: dict[str, np.ndarray]) -> dict[c.TensorSpec, np.ndarray]:
    return {spec: arrays[spec.name] for spec in specs}


def empty_h19() -> np.ndarray:
    """H19 of a step call (no user turn to route): a (1, 0) tensor keeps the output present and tiny."""
    return np.zeros((1, 0), np.float32)


def response(outputs: dict[c.TensorSpec, Any]) -> Any:
    return pb().InferenceResponse(output_tensors=[tensor(s, v) for s, v in outputs.items()])


def send_final(request: Any, response: Any) -> None:
    """Answer a request through its response sender (a model whose `execute` returned None: the one response, final),
    from the thread that owns the model's `pb_utils` objects."""
    request.get_response_sender().send(response, flags=pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def error_response(exc: BaseException) -> Any:
    """Short message for the client; anything that is not a ServingError is logged and reported generically.

    The error's code is what clients and load balancers act on: "server busy" is UNAVAILABLE (HTTP 503, gRPC
    UNAVAILABLE: retry), through the ensemble too; everything else keeps Triton's default code."""
    code = None
    if isinstance(exc, ServingError):
        message = str(exc)
        if isinstance(exc, ServerBusy):
            code = pb().TritonError.UNAVAILABLE
    elif isinstance(exc, UnicodeDecodeError):
        message = "a string input is not valid UTF-8"
    else:
        LOG.error("internal error: %s", traceback.format_exc())
        pb().Logger.log_error(traceback.format_exc())
        message = f"internal error ({type(exc).__name__}); see the server log"
    error = pb().TritonError(message) if code is None else pb().TritonError(message, code)
    return pb().InferenceResponse(output_tensors=[], error=error)


def announce_session_auth(model: str, enabled: bool) -> None:
    """Say at start-up, in the server log, whether sessions need their tokens: off is for a trusted single-tenant
    deployment only, and an operator reading the log must see that it is off."""
    if enabled:
        pb().Logger.log_info(f"mol2 {model}: session_auth on: a session's later turns, cancel and end need its "
                             "session_token")
    else:
        message = (f"mol2 {model}: session_auth is OFF: any client that knows or guesses a session id can read, "
                   "continue, cancel or end that conversation; use this only for a trusted single-tenant deployment")
        LOG.warning(message)
        pb().Logger.log_warn(message)


# ---------------------------------------------------------------------------------------------- BLS
def session_journal(args: dict, params: dict[str, str], vocab_size: int | None = None) -> "SessionJournal | None":
    """The encoder's session journal as its parameters say (repository.py, `session_dir`); the start-up report (what
    was resumable, dropped or refused as corrupt, by session) goes to the server log."""
    from tritonserver_backend.core.session_journal import SessionJournal, model_digest

    where = (params.get("session_dir") or "").strip() or os.environ.get("MOL2_SESSION_DIR", "").strip()
    if where.lower() == "off":
        pb().Logger.log_warn("mol2 encoder: session journal off: sessions live in memory only and do not survive a "
                             "restart")
        return None
    if not where:
        where = str(Path.cwd() / "sessions")
    directory = resolve(args, where)
    model_dir = resolve(args, params["model_dir"])
    journal = SessionJournal(directory, float(params.get("session_journal_ttl_s", 7 * 24 * 3600)),
                             int(params.get("session_journal_bytes", 1 << 30)), model_digest=model_digest(model_dir),
                             vocab_size=vocab_size)
    pb().Logger.log_info(f"mol2 encoder: session journal {directory}: {journal.report.summary()}")
    for session, why in journal.report.refused.items():
        pb().Logger.log_warn(f"mol2 encoder: session {session!r} cannot be resumed: {why}")
    return journal


def bls(model: str, inputs: dict[c.TensorSpec, Any], outputs: list[c.TensorSpec]) -> dict[str, np.ndarray]:
    request = pb().InferenceRequest(model_name=model, inputs=[tensor(s, v) for s, v in inputs.items()],
                                    requested_output_names=[o.name for o in outputs])
    resp = request.exec()
    if resp.has_error():
        raise BadRequest(resp.error().message())
    return {o.name: pb().get_output_tensor_by_name(resp, o.name).as_numpy() for o in outputs}


def bls_check_token(session_id: str, session_token: str | None) -> None:
    """Have the encoder (which issued it) check a session's token; its refusal comes back as this call's error."""
    empty = np.zeros(0, np.int64)
    inputs = {c.SESSION_ID: session_id, c.TOKEN_IDS: empty, c.PREFIX_IDS: empty, c.START: False, c.CHECK_TOKEN: True}
    bls("encoder", inputs if session_token is None else {**inputs, c.SESSION_TOKEN: session_token}, [])


def bls_control(session_id: str, action: str, key: "InternalKey") -> str:
    """A control action for the decoder (decoupled: its one response carries the outcome as JSON text), under the
    server's internal key (the decoder takes CONTROL from session_control only)."""
    inputs = [tensor(c.SESSION_ID, session_id), tensor(c.CONTROL, action), tensor(c.INTERNAL_KEY, key.value)]
    request = pb().InferenceRequest(model_name="decoder", inputs=inputs, requested_output_names=[c.TEXT_OUTPUT.name])
    for resp in request.exec(decoupled=True):
        if resp.has_error():
            raise BadRequest(resp.error().message())
        out = pb().get_output_tensor_by_name(resp, c.TEXT_OUTPUT.name)
        if out is not None:
            return out.as_numpy().reshape(-1)[0].decode()
    raise BadRequest("the decoder gave no answer")


# ---------------------------------------------------------------------------------------------- metrics
def export_counters(counters: Counters, names: list[str], label: str = "adapter", known: tuple[str, ...] = ()) -> None:
    """Mirror `counters` into Triton custom metrics `mol2_<counter>{<label>="..."}` on the metrics port (the second key
    of a count is the adapter for the routing counters, the kind of tokens for the encoder's). Series for the `known`
    label values exist from the start at 0 (a counter's series otherwise appears at its first increment, and a
    dashboard's rate() of a missing series shows no data instead of zero)."""
    pb_utils = pb()
    families = {n: pb_utils.MetricFamily(name=f"mol2_{n}", description=DESCRIPTIONS[n],
                                         kind=pb_utils.MetricFamily.COUNTER) for n in names}
    metrics: dict[tuple[str, str], Any] = {(n, value): families[n].Metric(labels={label: value})
                                           for n in names for value in known}

    def listener(counter: str, adapter: str, amount: int) -> None:
        if counter not in families:
            return
        key = (counter, adapter)
        if key not in metrics:
            metrics[key] = families[counter].Metric(labels={label: adapter})
        metrics[key].increment(amount)

    previous = counters.listener  # counters exported under another label stay exported

    def chained(counter: str, adapter: str, amount: int) -> None:
        if previous is not None:
            previous(counter, adapter, amount)
        listener(counter, adapter, amount)

    counters.listener = chained


SESSION_BYTES, SESSION_BUDGET = "mol2_session_bytes", "mol2_session_budget_bytes"
PREFIX_CACHE_BYTES, PREFIX_CACHE_BUDGET = "mol2_prefix_cache_bytes", "mol2_prefix_cache_budget_bytes"
TTFT_METRIC, ITL_METRIC = "mol2_time_to_first_token_seconds", "mol2_inter_token_latency_seconds"
GAUGE_METRICS = (SESSION_BYTES, SESSION_BUDGET, PREFIX_CACHE_BYTES, PREFIX_CACHE_BUDGET)
HISTOGRAM_METRICS = (TTFT_METRIC, ITL_METRIC)


class StoreGauges:
    """A bytes gauge and a budget gauge of one byte-bounded store (`total_bytes()`, `budget_bytes`), labelled
    store=`store_name`. `update()` is called by the thread that owns the model's `pb_utils` objects (the encoder's
    `execute`, the decoder's worker) and sets the gauge only when the bytes changed."""

    def __init__(self, store_name: str, store: Any, used: tuple[str, str], budget: tuple[str, str]) -> None:
        pb_utils = pb()
        gauge = pb_utils.MetricFamily.GAUGE
        used_family = pb_utils.MetricFamily(name=used[0], description=used[1], kind=gauge)
        budget_family = pb_utils.MetricFamily(name=budget[0], description=budget[1], kind=gauge)
        self.store, self._last, self._name = store, -1, used[0]
        self._families = (used_family, budget_family)  # a Metric is usable only while its MetricFamily object lives
        self._used = used_family.Metric(labels={"store": store_name})
        self._budget = budget_family.Metric(labels={"store": store_name})
        self._budget.set(float(store.budget_bytes))
        self.update()

    def update(self) -> None:
        """Never raises: a metric that cannot be written is logged, and the requests it follows are answered."""
        try:
            now = self.store.total_bytes()
            if now != self._last:
                self._used.set(float(now))
                self._last = now
        except Exception:  # noqa: BLE001 - monitoring must not fail a turn
            LOG.exception("could not update %s", self._name)


class SessionGauges(StoreGauges):
    """`mol2_session_bytes{store}` and `mol2_session_budget_bytes{store}` of one model's session store: what its
    sessions hold against the budget that evicts them."""

    def __init__(self, store_name: str, store: Any) -> None:
        super().__init__(store_name, store,
                         (SESSION_BYTES, "bytes of the sessions a model's store holds (store=encoder: encoder state; "
                                         "store=decoder: global-KV mirror, replay rows, rings)"),
                         (SESSION_BUDGET, "the store's budget: past it the least recently used sessions are evicted "
                                          "(session_budget_bytes)"))


class PrefixCacheGauges(StoreGauges):
    """`mol2_prefix_cache_bytes` and `mol2_prefix_cache_budget_bytes` of the encoder's prefix cache."""

    def __init__(self, cache: Any) -> None:
        super().__init__("encoder", cache,
                         (PREFIX_CACHE_BYTES, "bytes the encoder's prefix cache holds (encoder rows and hand-over rows "
                                              "of cached prefixes)"),
                         (PREFIX_CACHE_BUDGET, "the prefix cache's budget: past it the least recently used prefixes "
                                               "are evicted (prefix_cache_bytes; 0: off)"))


# seconds; Dynamo's frontend histograms cover the same range (first token: prefill of a long turn; ITL: one step)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LatencyHistograms:
    """`mol2_time_to_first_token_seconds` (once per turn) and `mol2_inter_token_latency_seconds` (once per turn: its
    mean gap between streamed tokens), the `Emitter`'s latency recorder, observed on the decoder's worker thread, the
    one that sends the responses. Why once per turn and not per token: each observation is an IPC round trip from the
    stub to the server, and a response per token already costs one (docs/load.md)."""

    def __init__(self) -> None:
        pb_utils = pb()
        histogram = pb_utils.MetricFamily.HISTOGRAM
        ttft = pb_utils.MetricFamily(name=TTFT_METRIC, kind=histogram,
                                     description="from the turn's arrival at the mol2 ensemble (its preprocess step) "
                                                 "to the response carrying its first token")
        itl = pb_utils.MetricFamily(name=ITL_METRIC, kind=histogram,
                                    description="a turn's mean time between its streamed tokens (first to last token "
                                                "response, over the tokens after the first), once per turn")
        self._families = (ttft, itl)  # a Metric is usable only while its MetricFamily object lives
        self._ttft = ttft.Metric(labels={}, buckets=list(TTFT_BUCKETS))
        self._itl = itl.Metric(labels={}, buckets=list(ITL_BUCKETS))

    def first_token(self, seconds: float) -> None:
        self._observe(self._ttft, seconds, TTFT_METRIC)

    def inter_token(self, seconds: float) -> None:
        self._observe(self._itl, seconds, ITL_METRIC)

    @staticmethod
    def _observe(metric: Any, seconds: float, name: str) -> None:
        try:
            metric.observe(seconds)
        except Exception:  # noqa: BLE001 - monitoring must not fail a turn
            LOG.exception("could not observe %s", name)
