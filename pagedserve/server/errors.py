"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status,
for our own errors, malformed bodies, unknown routes and unexpected failures alike. A client
that disconnects before its whole body arrives is not an error of ours: one log line."""
from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


# Seconds a client is asked to wait (Retry-After) before trying again after a 503 for a full
# queue: about a few engine steps' worth of requests leaving (the openai client honours it).
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers          # extra response headers (Retry-After)

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


def queue_full(error: Exception) -> APIError:
    """A 503 for a full queue, with Retry-After: the client backs off and tries again."""
    return APIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request body: " + "; ".join(parts), param


async def parse_body(raw: Request, model: type[BaseModel],
                     precheck: Callable[[bytes], None] | None = None) -> BaseModel:
    """The request body as `model` (after `precheck` on its bytes); a malformed one is a 400."""
    data = await raw.body()
    if precheck is not None:
        precheck(data)
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        raise invalid_body(e) from None


def invalid_body(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {errors[0].get('msg')}")
    message, param = _validation_message(errors)
    return APIError(400, message, param)


class UnexpectedErrorMiddleware:
    """The outermost of our middlewares: an exception nothing else handled is logged once (with
    its traceback) and answered 500, with Connection: close since the request may not have been
    read to its end. (Starlette's own handler would send the 500 and re-raise, so uvicorn logs a
    second traceback and drops the connection without saying so.) A body cut short by the
    client is logged in one line and answered with nothing: nobody is there to read it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:
            logger.info("client disconnected before sending the whole request body: %s %s",
                        scope["method"], scope["path"])
        except Exception as exc:
            if started:
                raise   # mid-response: only closing the connection is left, which uvicorn does
            logger.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
            await error.response(headers={"Connection": "close"})(scope, receive, send)


def _log_refusal(request: Request, error: APIError) -> None:
    state = getattr(request.app.state, "server", None)
    if state is not None:
        state.log_refusal(request.method, request.url.path, error)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _log_refusal(request, exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        error = APIError(400, message, param)
        _log_refusal(request, error)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        error = APIError(exc.status_code, message)
        _log_refusal(request, error)
        return error.response()

    app.add_middleware(UnexpectedErrorMiddleware)   # added last: outside the other middlewares
