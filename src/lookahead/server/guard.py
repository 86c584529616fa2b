"""What a request must pass before the app parses it: the API key, and a cap on the body size.

Both are ASGI middleware so that they run before body parsing: a request without the key is a
401 whatever its body, and a huge body is refused while it arrives instead of filling memory.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response


class RequireApiKey:
    """Requests under /v1/ must send `Authorization: Bearer KEY`; /health and /metrics stay open for probes."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = "missing or incorrect API key: send the header 'Authorization: Bearer KEY'"
                await error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """Reads a request body of at most `limit` bytes, then hands it to the app; a larger one is a 413."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(APIError(413, f"the request body is larger than {self.limit} bytes"))
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: only the disconnect is left to hear
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
