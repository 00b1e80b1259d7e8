"""The ASGI app: OpenAI-compatible endpoints in front of the engine (starlette; uvicorn runs it).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health
    GET /metrics (Prometheus text)   GET|POST /admin/policy (loopback clients only by default)

Handlers validate, hand a `Job` to the engine thread and read its outbox; nothing here runs
the model. A client that disconnects cancels its job, which frees its row at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections import Counter

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.decode.plan import Mode
from . import api
from .api import ApiError, Completion, ServeLimits, TextStream
from .engine import Engine, EngineStopped, Job, QueueFull
from .policy import PolicyError

log = logging.getLogger("mars.serve")

RETRY_AFTER_SECONDS = 1
ADMIN_FIELDS = ("policy", "default_mode", "default_threshold", "min_threshold", "max_threshold", "full_load", "hold")


class JobFailed(Exception):
    """The engine ended the job with an error (a failed forward, a shutdown)."""


class Reader:
    """Follows one job: text deltas with stop strings applied, and the usage numbers."""

    def __init__(self, engine: Engine, req: Completion, job: Job):
        self.engine, self.req, self.job = engine, req, job
        self.text = TextStream(engine.session.tokenizer, req.stop)
        self.completion_tokens = 0
        self.forwards = 0
        self.finish: str | None = None
        # With logprobs: the reply decoded token by token (where each token's text ends), the tokens whose
        # entries wait for their text to go out (token, entry, where its text ends), and those released by
        # the last `next` (token, entry).
        self.ends = TextStream(engine.session.tokenizer, [])
        self.pending: list[tuple] = []
        self.released: list[tuple] = []
        self.offset = 0  # completions' text_offset: the text before the next released token

    async def next(self) -> str:
        """The next piece of text (maybe empty); sets `finish` once the job is over, and `released`,
        the tokens (with their log-probabilities, where asked for) whose text this piece completes."""
        ids, forwards, finish = await self.job.outbox.take()
        self.completion_tokens += len(ids)
        self.forwards += forwards
        if self.req.logprobs is not None:
            for t, e in zip(ids, self.job.outbox.taken_logprobs):
                self.ends.add([t])  # incremental: a few tokens decoded per token, not the whole reply
                self.pending.append((t, e, len(self.ends.text)))
        delta = self.text.add(ids)
        if self.text.stopped:
            self.engine.cancel(self.job)  # the rest is not wanted: free the row now
            self.finish = "stop"
        elif finish == "error":
            raise JobFailed(self.job.outbox.error or "decoding failed")
        elif finish is not None:
            delta += self.text.flush()
            self.finish = finish
        # A token's entry goes out with the text it ends; past a stop string, none does.
        everything = self.finish is not None and self.finish != "stop"
        out = [p for p in self.pending if everything or p[2] <= self.text.sent]
        self.pending = [] if self.finish is not None else self.pending[len(out) :]
        self.released = [(t, e) for t, e, _ in out]
        return delta

    def logprobs(self, released: list[tuple]) -> dict | None:
        """The choice's `logprobs` for these released tokens (None where the request asked none)."""
        if self.req.logprobs is None:
            return None
        tokens, entries = [t for t, _ in released], [e for _, e in released]
        out = api.choice_logprobs(self.req, self.engine.session.tokenizer, tokens, entries, self.offset)
        if not self.req.chat and out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    @property
    def done(self) -> bool:
        return self.finish is not None

    def usage(self) -> dict:
        threshold = (
            None if self.job.plan is not None and self.job.plan.mode is Mode.LOSSLESS else self.job.outbox.threshold
        )
        return api.usage(
            len(self.req.prompt),
            self.completion_tokens,
            self.forwards,
            threshold,
            self.engine.mode_name(self.job, threshold),
        )


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


async def read_json(request: Request, limit: int):
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None


def metrics_text(engine: Engine, statuses: Counter) -> str:
    recent = engine.recent()
    window = f"{engine.limits.stats_window:g}"
    lines = [
        "# HELP mars_requests_total HTTP requests answered, by status code.",
        "# TYPE mars_requests_total counter",
        *(f'mars_requests_total{{status="{code}"}} {n}' for code, n in sorted(statuses.items())),
        "# HELP mars_queue_depth Requests waiting for a row in the batch.",
        "# TYPE mars_queue_depth gauge",
        f"mars_queue_depth {engine.queue_depth}",
        "# HELP mars_rows_in_flight Requests being decoded.",
        "# TYPE mars_rows_in_flight gauge",
        f"mars_rows_in_flight {engine.in_flight}",
        f"# HELP mars_tokens_per_second Generated tokens per second over the last {window} s.",
        "# TYPE mars_tokens_per_second gauge",
        f"mars_tokens_per_second {recent['tokens_per_second']:.6g}",
        f"# HELP mars_tokens_per_forward Generated tokens per counted row forward over the last {window} s.",
        "# TYPE mars_tokens_per_forward gauge",
        f"mars_tokens_per_forward {recent['tokens_per_forward']:.6g}",
        "# HELP mars_threshold The threshold in force (requests without their own threshold decode at it).",
        "# TYPE mars_threshold gauge",
        f"mars_threshold {engine.policy.threshold:.6g}",
        "# HELP mars_policy_info The threshold policy.",
        "# TYPE mars_policy_info gauge",
        f'mars_policy_info{{policy="{engine.policy.settings.policy}",metric="{engine.policy.metric}"}} 1',
        "# HELP mars_generated_tokens_total Tokens generated since start.",
        "# TYPE mars_generated_tokens_total counter",
        f"mars_generated_tokens_total {engine.tokens_total}",
        "# HELP mars_forwards_total Batch forwards run since start.",
        "# TYPE mars_forwards_total counter",
        f"mars_forwards_total {engine.forwards_total}",
    ]
    return "\n".join(lines) + "\n"


class CountStatuses:
    """ASGI middleware: counts responses by status code for /metrics."""

    def __init__(self, app, counts: Counter):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counts[str(message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine, limits: ServeLimits | None = None, *, admin_from_anywhere: bool = False) -> Starlette:
    """The app; its lifespan starts and stops the engine thread."""
    limits = limits or ServeLimits()
    statuses: Counter = Counter()

    async def completions(request: Request, chat: bool) -> Response:
        body = await read_json(request, limits.max_body_bytes)
        req = api.parse(
            body, chat=chat, session=engine.session, names=engine.names, policy=engine.policy, limits=limits
        )
        job = Job(
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            outbox=engine.new_outbox(asyncio.get_running_loop()),
            sampling=req.sampling,
            lossless=req.lossless,
            verify=req.verify,
            threshold=req.threshold,
            pinned=req.pinned,
            logprobs=req.logprobs,
        )
        try:
            engine.submit(job)
        except QueueFull as e:
            raise ApiError(
                429,
                f"the server is busy ({e}); retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        except EngineStopped as e:
            raise ApiError(
                503, f"the server cannot decode now: {e}", type="server_error", code="engine_stopped"
            ) from None
        reader = Reader(engine, req, job)
        rid, created = api.new_id(chat), api.now()
        if req.stream:
            return StreamingResponse(
                stream(reader, rid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await complete(request, reader, rid, created)

    async def complete(request: Request, reader: Reader, rid: str, created: int) -> Response:
        watcher = asyncio.create_task(cancel_on_disconnect(request, reader.job))
        parts, released = [], []
        try:
            while not reader.done:
                parts.append(await reader.next())
                released += reader.released
        except JobFailed as e:
            raise ApiError(500, str(e), type="server_error", code="decoding_failed") from None
        finally:
            watcher.cancel()
            engine.cancel(reader.job)  # no-op once finished; frees the row if anything went wrong
        if reader.finish == "cancelled":
            return Response(status_code=499)  # the client is gone; nobody reads this
        finish = api.FINISH[reader.finish]
        text, mode = "".join(parts), reader.job.plan.mode
        return JSONResponse(
            api.response(reader.req, rid, created, text, finish, reader.usage(), reader.logprobs(released), mode)
        )

    async def cancel_on_disconnect(request: Request, job: Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                engine.cancel(job)
                return

    async def stream(reader: Reader, rid: str, created: int):
        req = reader.req
        try:
            if req.chat:
                yield sse(api.chunk(req, rid, created, first=True))
            while not reader.done:
                delta = await reader.next()
                if reader.finish == "cancelled":
                    return
                if delta or reader.released:
                    logprobs, mode = reader.logprobs(reader.released), reader.job.plan.mode
                    yield sse(api.chunk(req, rid, created, text=delta, logprobs=logprobs, mode=mode))
            yield sse(api.chunk(req, rid, created, finish=api.FINISH[reader.finish]))
            if req.include_usage:
                yield sse(api.chunk(req, rid, created, use=reader.usage(), usage_chunk=True))
        except JobFailed as e:
            yield sse(api.error_body(str(e), type="server_error", code="decoding_failed"))
        finally:
            # Runs on disconnect too (the server cancels this generator): free the row at once.
            engine.cancel(reader.job)
        yield "data: [DONE]\n\n"

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(engine.started_wall), "owned_by": "mars"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(engine.name)]})

    async def one_model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in engine.names:
            raise ApiError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(name))

    async def health(request: Request) -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "error": engine.failed or "the engine is not running"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(engine, statuses), media_type="text/plain; version=0.0.4")

    async def admin_policy(request: Request) -> Response:
        if not admin_from_anywhere and not is_loopback(request):
            raise ApiError(
                403,
                "admin endpoints answer loopback clients only (start the server with --admin-from-anywhere to change "
                "that)",
                type="permission_error",
                code="admin_loopback_only",
            )
        if request.method == "GET":
            return JSONResponse(engine.policy.describe())
        body = await read_json(request, limits.max_body_bytes)
        if not isinstance(body, dict):
            raise ApiError(
                400, 'the request body must be a JSON object like {"policy": "adaptive", "min_threshold": 0.7}'
            )
        unknown = sorted(set(body) - set(ADMIN_FIELDS))
        if unknown:
            raise ApiError(400, f"unknown field '{unknown[0]}' (known: {', '.join(ADMIN_FIELDS)})", param=unknown[0])
        if isinstance(body.get("full_load"), float) and body["full_load"].is_integer():
            body["full_load"] = int(body["full_load"])
        try:
            return JSONResponse(engine.policy.configure(**body))
        except PolicyError as e:
            raise ApiError(400, str(e)) from None

    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            api.error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error", exc_info=exc)
        return JSONResponse(
            api.error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", one_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/policy", admin_policy, methods=["GET", "POST"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
        middleware=[Middleware(CountStatuses, counts=statuses)],
        lifespan=lifespan,
    )
    return app
