"""The async gRPC side: one turn of the `mol2` ensemble as an async stream of pieces, the adapter list, cancel.

One bidirectional stream per turn over one shared channel (tritonclient's asyncio client), so the event loop serves
every HTTP request without a thread each. The request iterator stays open until the final response: closing our half
early is legal gRPC, but keeping it open means nothing depends on how Triton treats a half-closed decoupled stream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from openai_frontend.errors import APIError, explained_by, from_triton, unavailable
from tritonserver_backend import contract as c
from tritonserver_backend.auth.admin_auth import ADMIN_KEY_HEADER as ADMIN_KEY_PARAMETER
from tritonserver_backend.clients.client import TurnRequest, infer_inputs, text_output


@dataclass(frozen=True)
class Piece:
    token_ids: tuple[int, ...]  # several when the server groups tokens (stream_interval); () on the final response
    text: str
    adapter: str
    finish: str  # "" while streaming
    logprobs: tuple[float, ...] = ()  # with logprobs: one per token id
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # with top_logprobs k: per token id, k (id, log-probability)
    session_token: str = ""  # issued_session_token: the session's new token on a turn that (re)started it, else ""


def _logprobs(result: Any, n: int) -> tuple[tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]:
    """A response's log-probabilities: one per token id, and the top-k (id, log-probability) of each (k may be 0)."""
    token_lp = result.as_numpy(c.TOKEN_LOGPROB_OUT.name)
    if token_lp is None or token_lp.size != n:
        return (), ()
    ids, lps = result.as_numpy(c.TOP_TOKEN_ID_OUT.name), result.as_numpy(c.TOP_LOGPROB_OUT.name)
    k = ids.size // n if ids is not None and n else 0
    top = tuple(tuple(zip((int(i) for i in row_ids), (float(x) for x in row_lps)))
                for row_ids, row_lps in zip(ids.reshape(n, k), lps.reshape(n, k))) if k else ((),) * n
    return tuple(float(x) for x in token_lp.reshape(-1)), top


def _message(error: Any) -> str:
    return error.message() if hasattr(error, "message") else str(error)


class TritonStream:
    def __init__(self, url: str, health_url: str | None = None) -> None:
        """`health_url`: the server supervisor's `/health` (scripts/tritonserver.py start prints it): a 503 then says
        which model died and that the server is healing (errors.explained_by)."""
        import tritonclient.grpc.aio as grpc_aio

        self._aio = grpc_aio
        self.url = url
        self.health_url = health_url
        self._client: Any = None
        # cancels sent for turns whose client left; held here until they finish: the event loop keeps only weak
        # references to tasks, and the task that started one is itself being cancelled, so nothing else would
        self._cancels: set[asyncio.Task] = set()

    @property
    def client(self) -> Any:
        """Made at first use: a grpc.aio channel belongs to the event loop it was created on (uvicorn's)."""
        if self._client is None:
            self._client = self._aio.InferenceServerClient(self.url)
        return self._client

    def _inputs(self, tensors: dict[c.TensorSpec, Any]) -> list[Any]:
        return infer_inputs(self._aio, tensors)

    async def turn(self, request: TurnRequest) -> AsyncIterator[Piece]:
        """The turn's pieces, the last one with its finish reason; a Triton error raises the matching APIError. If the
        consumer stops early (the HTTP client left), the turn is cancelled on the server (session_control), with the
        session's token: the one the request carried, or the one the server issued for this turn.

        A streamed turn that (re)starts a session first gets a response of its own with the issued token and no token
        ids: it is not a piece (the first piece stays the first token, so an error before it keeps its HTTP status and
        the adapter is known), but from then on a cancel can name the token; every piece of the turn carries it."""
        done = asyncio.Event()
        seen = {"issued": ""}  # the token the server issued for this turn (it (re)started the session), else ""
        inputs = self._inputs(request.tensors())
        outputs = [self._aio.InferRequestedOutput(s.name) for s in c.ENSEMBLE_OUTPUTS]

        async def requests() -> AsyncIterator[dict]:
            yield {"model_name": c.ENSEMBLE_NAME, "inputs": inputs, "outputs": outputs}
            await done.wait()

        stream = self.client.stream_infer(requests())
        finished = False
        try:
            try:
                async for piece in self._pieces(stream, request, seen):
                    finished = bool(piece.finish)
                    yield piece
                    if finished:
                        return
            except APIError as exc:
                finished = finished or exc.status != 503  # the server ended the request itself: nothing to cancel
                raise await self.explain(exc) from None
        finally:
            done.set()
            if not finished:
                stream.cancel()
                token = seen["issued"] or request.session_token
                cancel = asyncio.ensure_future(self._cancel_quietly(request.session_id, token))
                self._cancels.add(cancel)
                cancel.add_done_callback(self._cancels.discard)
                await asyncio.shield(cancel)  # the caller's own cancellation (it left) never stops the cancel

    async def _pieces(self, stream: Any, request: TurnRequest, seen: dict[str, str]) -> AsyncIterator[Piece]:
        """The stream's pieces until the final one (`seen["issued"]`: the session token issued on the way); Triton's
        errors as APIErrors."""
        try:
            async for result, error in stream:
                if error is not None:
                    raise from_triton(_message(error))
                seen["issued"] = issued = text_output(result, c.ISSUED_SESSION_TOKEN) or seen["issued"]
                token_ids = result.as_numpy(c.TOKEN_ID_OUT.name)
                if token_ids is None:
                    continue
                ids = tuple(int(t) for t in token_ids.reshape(-1) if t >= 0)
                finish = text_output(result, c.FINISH_REASON)
                if not token_ids.size and not finish:
                    continue  # the issued token's own response (see above): nothing to show yet
                piece = Piece(ids, text_output(result, c.TEXT_OUTPUT), text_output(result, c.ADAPTER_NAME), finish,
                              *(_logprobs(result, len(ids)) if request.logprobs else ((), ())), session_token=issued)
                yield piece
                if piece.finish:
                    return
            raise unavailable("tritonserver closed the stream before the reply ended")
        except self._aio.InferenceServerException as exc:
            raise _transport_error(exc) from None
        except grpc.RpcError as exc:  # the aio stream passes a lost connection on as grpc's own error
            raise _rpc_error(exc) from None

    async def explain(self, error: APIError) -> APIError:
        """A 503 with the supervisor's account of it (which model died, healing or healed), when it can be asked."""
        if error.status != 503 or not self.health_url:
            return error
        try:
            health = await asyncio.to_thread(_read_health, self.health_url)
        except Exception:  # noqa: BLE001 - the supervisor is not reachable either: the plain 503 stands
            return error
        return explained_by(error, health)

    async def _cancel_quietly(self, session_id: str, session_token: str | None) -> None:
        try:
            await self.cancel(session_id, session_token)
        except Exception:  # noqa: BLE001 - best effort: the turn may have ended meanwhile, or the server be gone
            pass

    async def _infer(self, model: str, tensors: dict[c.TensorSpec, Any], output: c.TensorSpec,
                     parameters: dict[str, str] | None = None) -> str:
        try:
            result = await self.client.infer(model, self._inputs(tensors),
                                             outputs=[self._aio.InferRequestedOutput(output.name)],
                                             parameters=parameters)
        except self._aio.InferenceServerException as exc:
            raise await self.explain(_transport_error(exc)) from None
        return result.as_numpy(output.name).reshape(-1)[0].decode("utf-8")

    async def adapters(self) -> list[str]:
        """Names of the loaded adapters (`adapter_admin` list, open to everyone)."""
        answer = json.loads(await self._infer(c.ADMIN.name, {c.ACTION: "list"}, c.RESULT))
        return [a["name"] for a in answer["adapters"]]

    async def administer(self, action: str, name: str, admin_key: str | None, path: str = "",
                         description: str = "") -> dict:
        """`adapter_admin` load / unload with the caller's admin key as the request parameter the server checks
        (docs/admin.md): the frontend holds no key of its own, so it can change nothing a caller could not."""
        tensors = {c.ACTION: action, c.ADAPTER: name}
        if path:
            tensors[c.ADAPTER_PATH] = path
        if description:
            tensors[c.DESCRIPTION] = description
        parameters = {ADMIN_KEY_PARAMETER: admin_key} if admin_key else None
        return json.loads(await self._infer(c.ADMIN.name, tensors, c.RESULT, parameters))

    async def cancel(self, session_id: str, session_token: str | None = None) -> dict:
        """Stop the session's turn in flight (`session_control` cancel), with its token (needed with session_auth
        on)."""
        tensors: dict[c.TensorSpec, Any] = {c.SESSION_ID: session_id, c.CONTROL_ACTION: "cancel"}
        if session_token:
            tensors[c.CONTROL_TOKEN] = session_token
        return json.loads(await self._infer(c.SESSION_CONTROL.name, tensors, c.RESULT))

    async def end(self, session_id: str, session_token: str | None = None) -> dict:
        """Drop an idle session on the server without a turn (`session_control` "end"), with its token."""
        tensors: dict[c.TensorSpec, Any] = {c.SESSION_ID: session_id, c.CONTROL_ACTION: "end"}
        if session_token:
            tensors[c.CONTROL_TOKEN] = session_token
        return json.loads(await self._infer(c.SESSION_CONTROL.name, tensors, c.RESULT))

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready())
        except Exception:  # noqa: BLE001 - not reachable is "not ready"
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def _rpc_error(exc: Any) -> APIError:
    """grpc's error as the OpenAI error: a server that cannot be reached (down, restarting) is a 503 to retry."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return unavailable(f"tritonserver is not reachable: {details}")
    return from_triton(str(details))


def _transport_error(exc: Any) -> APIError:
    message = _message(exc)
    status = str(getattr(exc, "status", lambda: "")() or "")
    if "UNAVAILABLE" in status or "failed to connect" in message.lower() or "connection refused" in message.lower():
        return unavailable(f"tritonserver is not reachable: {message}")
    return from_triton(message)


def _read_health(url: str) -> dict:
    import urllib.error
    import urllib.request

    url = url if url.rstrip("/").endswith("/health") else url.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 while healing still carries the JSON
        return json.loads(exc.read())
