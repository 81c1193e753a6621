"""Errors as HTTP responses: OpenAI's body for every route but Ollama's (under `/api/`), whose
body is `{"error": message}`, and Anthropic's (`/v1/messages...`), whose body is
`{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lmnb.params import ContextLengthError, InvalidRequestError


class APIError(Exception):
    """Raised by a route: becomes `status` with the OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code)


OLLAMA_PREFIX = "/api/"
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {"server_error": "api_error"}  # OpenAI's error types Anthropic names otherwise


def is_anthropic(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (`/v1/messages`, `/v1/messages/...`)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None, path: str = "") -> dict[str, Any]:
    """The error body of a response to `path`."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    if is_anthropic(path):
        kind = ("request_too_large" if code == "request_too_large"
                else _ANTHROPIC_TYPES.get(type, type))
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def refused(error: InvalidRequestError, path: str) -> APIError:
    """The runtime's refusal of a request to `path`: a 400; one over the context length with
    OpenAI's code `context_length_exceeded`, and in Anthropic's words on its route."""
    if not isinstance(error, ContextLengthError):
        return APIError(str(error), param=error.param)
    if is_anthropic(path) and error.max_new_tokens is not None:
        return APIError(f"input length and `max_tokens` exceed context limit: "
                        f"{error.prompt_tokens} + {error.max_new_tokens} > {error.context_len}, "
                        "decrease input length or `max_tokens` and try again")
    return APIError(str(error), code="context_length_exceeded")


def error_response(error: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(error.message, type=error.type, param=error.param,
                                   code=error.code, path=path), status_code=error.status)


_JSON_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _body_problem(first: dict[str, Any], content_type: str | None) -> APIError | None:
    """The body as a whole is wrong: not sent as JSON (415), absent, or not an object."""
    if tuple(first.get("loc", ())) != ("body",):
        return None
    value = first.get("input")
    if isinstance(value, bytes):  # FastAPI parses JSON only when the content type says so
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return APIError(f"the body must be a JSON object sent with Content-Type: "
                        f"application/json; got {got}", status=415,
                        code="unsupported_media_type")
    if first.get("type") == "missing":
        return APIError("the request has no body; a JSON object is expected")
    return APIError(f"the body must be a JSON object, got "
                    f"{_JSON_NAMES.get(type(value), type(value).__name__)}")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first problem in words, and the parameter it is about."""
    details = error.errors()
    if not details:
        return "invalid request", None
    first = details[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg', '')}", None
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (
        loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """Bad JSON and bad parameters are 400s; the runtime's `InvalidRequestError` too."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error, request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, error: InvalidRequestError) -> JSONResponse:
        return error_response(refused(error, request.url.path), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        details = error.errors()
        problem = details and _body_problem(details[0], request.headers.get("content-type"))
        if problem:
            return error_response(problem, request.url.path)
        message, param = _validation_message(error)
        return error_response(APIError(message, param=param), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception) -> JSONResponse:
        return error_response(APIError(f"{type(error).__name__}: {error}", status=500,
                                       type="server_error"), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(error.detail), status=error.status_code, type=kind),
                              request.url.path)
