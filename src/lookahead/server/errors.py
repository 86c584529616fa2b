"""OpenAI-style error bodies for every failure, so clients see `{"error": {...}}` and never a traceback.

Bad input is a 4xx with the offending parameter named; only a fault of the server itself is a
500, and its details go to the log, not to the client.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}


class APIError(Exception):
    """A request the server answers with an error status, as OpenAI's API would."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


def _param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') → 'messages[0].content'."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or None


def _validation_message(error: dict) -> str:
    if error["type"] == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', 'decode error')}"
    if error["type"] == "missing" and tuple(error["loc"]) == ("body",):
        return "the request body is empty: send a JSON object"
    message = str(error["msg"]).removeprefix("Value error, ")
    param = _param(tuple(error["loc"]))
    return f"{param}: {message}" if param else message


def install(app: FastAPI) -> None:
    """Route every error the app can raise to an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        param = None if first["type"] == "json_invalid" else _param(tuple(first["loc"]))
        return error_response(APIError(400, _validation_message(first), param, "invalid_value"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}"
        return error_response(APIError(err.status_code, message, headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:  # the traceback goes to the server log
        return error_response(APIError(500, "internal server error; see the server log"))
