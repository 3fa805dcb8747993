"""A streaming response that closes its body when the client leaves, at once.

Starlette's `StreamingResponse` stops iterating its body when the client disconnects but does not close it: the body
(our async generator of SSE events) stays suspended at its `yield` until the garbage collector finalizes it. The
generator's `finally` is what cancels the turn on the server (`TritonStream.turn`), so the abandoned turn ran on for
as long as the collector took: CI saw a 1,300-token turn finish before its cancel was sent. Closing the body in our own
`finally`, shielded from the cancellation that ended the response, sends the cancel as soon as the client is gone.
"""

from __future__ import annotations

import anyio
from fastapi.responses import StreamingResponse


class ClosingStreamingResponse(StreamingResponse):
    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
