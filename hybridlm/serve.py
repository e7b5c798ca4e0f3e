"""An OpenAI-compatible HTTP server over a `Chat`: `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/completions`, streaming as server-sent events, on FastAPI and uvicorn.

Requests start in arrival order: each waits for its turn in a FIFO queue (`FifoTurns`), then its `ReplyStream`
runs on one worker thread (the model's calls block). With a `Chat(batch_decode=True)` (what `hybridlm serve`
makes) the turn passes on once the reply has prefilled and joined the shared decode batch
(`engine.batch.DecodeBatcher`): replies then decode together, one decode step for all, each waiting for its
own tokens on a thread of its own. Without it a reply holds the turn to its end. A client that disconnects,
while queued or mid-reply, gives up its turn or its batch row at once: its reply is closed and the next
request starts. Errors are OpenAI error bodies
(`{"error": {"message", "type", "param", "code"}}`): 400 for malformed or invalid requests and for prompts
past the context (`context_length_exceeded`), 404 for an unknown model.

Source: the OpenAI API reference (chat completions, completions, models; streaming chunks and error bodies).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Literal

import fastapi
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridlm.chat import Chat, ReplyStats, ReplyStream
from hybridlm.engine.sampling import check_sampling

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # a request without max_tokens: this, or what is left of the context if less
SHUTDOWN_GRACE_S = 5  # seconds uvicorn waits for open requests after the server was told to stop


class ApiError(Exception):
    """A request the server refuses: sent as an OpenAI error body with `status`."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


# ---- requests ---------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take; strict types (a string is not a number), unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1, as OpenAI
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; 0 or -1: no limit
    stop: str | list[str] | None = None
    seed: int | None = None  # None: a random seed per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _supported(self):
        """Options this server cannot honour are refused rather than ignored."""
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        return self

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, stop):
        if stop == "" or (isinstance(stop, list) and not all(stop)):
            raise ValueError("stop strings must be non-empty")
        return stop


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. "reasoning_content") reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[_TextPart]

    def for_template(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatTemplateOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    enable_thinking: bool = False


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    chat_template_kwargs: ChatTemplateOptions | None = None  # vLLM's extension: thinking on/off
    logprobs: bool | None = None
    tools: list | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.logprobs or self.tools:
            raise ValueError("logprobs and tools are not supported")
        return self


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]  # text, a list of one text, or token ids
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt: a list of {len(self.prompt)} texts; only one prompt is supported")
        if self.echo or self.logprobs is not None or self.suffix is not None or (self.best_of or 1) != 1:
            raise ValueError("echo, logprobs, suffix and best_of are not supported")
        return self


def _validation_error(e: RequestValidationError) -> ApiError:
    """The first problem of a request FastAPI could not validate, as one 400 error naming the field."""
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return ApiError(400, f"the request body is not valid JSON: {reason}")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    got = repr(first.get("input"))
    if first.get("type") != "missing" and len(got) <= 40:
        message += f", got {got}"
    if not loc:
        return ApiError(400, message)
    return ApiError(400, f"{'.'.join(loc)}: {message}", param=loc[0])


# ---- the queue and the worker ------------------------------------------------------------------------------


class FifoTurns:
    """First-come first-served turns for the requests of one event loop (an asyncio.Lock guarantees no order
    across its implementations and gives no way to leave the queue from outside the waiting task)."""

    def __init__(self):
        self._held = False
        self._queue: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests queued behind the one that holds the turn."""
        return sum(not f.done() for f in self._queue)

    def request(self) -> asyncio.Future:
        """A future that completes when the caller holds the turn (at once when it is free)."""
        turn = asyncio.get_running_loop().create_future()
        if self._held or self._queue:
            self._queue.append(turn)
        else:
            self._held = True
            turn.set_result(None)
        return turn

    def withdraw(self, turn: asyncio.Future) -> None:
        """Gives `turn` up: a held turn passes to the next in line, a queued one leaves the queue."""
        if turn.done() and not turn.cancelled():
            self.release()
        else:
            turn.cancel()
            with contextlib.suppress(ValueError):
                self._queue.remove(turn)

    def release(self) -> None:
        """Passes the held turn to the first request still waiting, else frees it."""
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._held = False


class _Worker:
    """One daemon thread running the model's blocking calls in order (a daemon so that a long prefill never
    holds the process at exit)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hybridlm-decode", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self, timeout: float) -> None:
        """Lets the queued calls finish, then ends the thread (waiting `timeout` seconds at most)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001  (handed to the waiting request)
                    future.set_exception(e)


class _Stopped(Exception):
    """The request ended before its reply did: the client disconnected, or the server is shutting down."""


class _Job:
    """One request's reply: waits for its turn, then pulls text deltas from the worker until the reply ends,
    the client disconnects or the server stops. `close()` (idempotent) always follows."""

    def __init__(self, service: _Service, reply: ReplyStream, request: fastapi.Request):
        self.service, self.reply, self.stats = service, reply, reply.stats
        self._turn: asyncio.Future | None = None
        self._released = False  # the turn passed on while the reply decodes in the batch
        self._inflight: concurrent.futures.Future | None = None
        self._closed = False
        self._stop = asyncio.get_running_loop().create_future()  # result: why the request stopped
        self._listener = asyncio.ensure_future(self._watch(request))
        service.jobs.add(self)

    async def _watch(self, request: fastapi.Request) -> None:
        with contextlib.suppress(Exception):  # a receive that fails: the connection is gone too
            while (await request.receive())["type"] != "http.disconnect":
                pass
        self.stop("the client disconnected")

    def stop(self, reason: str) -> None:
        if not self._stop.done():
            self._stop.set_result(reason)

    async def _until(self, awaitable):
        """`awaitable`'s result, unless the request stops first (then `_Stopped`)."""
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({task, self._stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise _Stopped(self._stop.result() if self._stop.done() else "cancelled")
        return task.result()

    async def deltas(self) -> AsyncIterator[str]:
        self._turn = self.service.turns.request()
        await self._until(asyncio.shield(self._turn))
        while True:
            if self._stop.done():
                raise _Stopped(self._stop.result())
            if self.reply.decoding and not self._released:  # prefilled and in the batch: the next may start
                self._released = True
                self.service.turns.release()
            runs = self.service.readers if self._released else self.service.worker
            self._inflight = runs.submit(next, self.reply, None)
            delta = await self._until(asyncio.wrap_future(self._inflight))
            if delta is None:
                return
            yield delta

    def close(self) -> None:
        """Ends the request: a running reply is closed on the worker (after the call in flight), then the turn
        passes on; a queued one leaves the queue."""
        if self._closed:
            return
        self._closed = True
        self._listener.cancel()
        self.service.jobs.discard(self)
        self.reply.cancel()  # a reply waiting for its batch's tokens returns now
        if self._released:  # its turn passed on already: close it once its last call has returned
            inflight = self._inflight
            if inflight is None or inflight.done():
                self.service.readers.submit(self.reply.close)
            else:
                inflight.add_done_callback(lambda _: self.reply.close())
            return
        turn, turns = self._turn, self.service.turns
        if turn is None or not turn.done() or turn.cancelled():
            if turn is not None:
                turns.withdraw(turn)
            self.reply.close()  # never started: nothing runs it
            return
        loop = asyncio.get_running_loop()

        def release(_) -> None:  # on the worker thread, once the reply is closed
            with contextlib.suppress(RuntimeError):  # the loop has ended: nobody waits for the turn
                loop.call_soon_threadsafe(turns.release)

        self.service.worker.submit(self.reply.close).add_done_callback(release)


class _Service:
    """What the endpoints share: the chat, the queue, the worker and the requests in flight."""

    def __init__(self, chat: Chat, model_name: str, default_max_tokens: int):
        self.chat, self.model_name, self.default_max_tokens = chat, model_name, default_max_tokens
        self.turns = FifoTurns()
        self.worker = _Worker()
        # the threads that wait for batched replies' tokens (one call each at a time)
        self.readers = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="hybridlm-reply")
        self.jobs: set[_Job] = set()

    def stop_all(self, reason: str) -> None:
        for job in list(self.jobs):
            job.stop(reason)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server has {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def start(
        self, ids: Sequence[int], body: _Request, max_tokens: int | None, request, history: int | None = None
    ) -> _Job:
        """The job answering prompt `ids` with `body`'s sampling settings; `history`: the length of the
        prompt's conversation history, whose state the prefix cache saves (`Chat.complete_ids`).

        Raises:
          ApiError: a prompt past the context, token ids outside the vocabulary, or settings Chat refuses.
        """
        context, vocab = self.chat.max_context, self.chat.runner.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        room = context - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = "" if max_tokens is None else f" + max_tokens {max_tokens}"
            raise ApiError(
                400,
                f"the prompt's {len(ids)} tokens{asked} exceed this model's context of {context} tokens "
                f"(a reply needs at least 1)",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = min(self.default_max_tokens, room) if max_tokens is None else max_tokens
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        top_k = max(body.top_k or 0, 0)
        seed = secrets.randbits(32) if body.seed is None else body.seed % 2**32
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            check_sampling(temperature, top_k, top_p)
            reply = self.chat.complete_ids(
                ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                history_length=history,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return _Job(self, reply, request)


# ---- responses ---------------------------------------------------------------------------------------------


def _usage(stats: ReplyStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _error_body(message: str) -> dict:
    """The error event of a stream that cannot finish (its status, 200, is already sent)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class _Reply:
    """The OpenAI shapes of one response: chat ("chat.completion", deltas) or text ("text_completion")."""

    def __init__(self, chat: bool, model: str, include_usage: bool):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def whole(self, text: str, stats: ReplyStats) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=stats.finish_reason)
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": [choice], "usage": _usage(stats)}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            )
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        chunk = {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    async def events(self, job: _Job) -> AsyncIterator[str]:
        """The server-sent events of a streamed reply, ending in `data: [DONE]`."""
        try:
            if self.chat:
                yield _event(self.chunk(None, role=True))
            async for delta in job.deltas():
                yield _event(self.chunk(delta))
            yield _event(self.chunk(None, job.stats.finish_reason))
            if self.include_usage:
                yield _event({**self.chunk(None), "choices": [], "usage": _usage(job.stats)})
        except _Stopped as e:
            yield _event(_error_body(str(e)))
        except Exception as e:  # noqa: BLE001  (the status is sent: the error becomes the last event)
            logger.exception("reply %s failed", self.id)
            yield _event(_error_body(f"{type(e).__name__}: {e}"))
        finally:
            job.close()
        yield _event("[DONE]")


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes its job however the response ends (a failed send included)."""

    def __init__(self, events: AsyncIterator[str], job: _Job):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def _whole(reply: _Reply, job: _Job) -> dict:
    parts = []
    try:
        async for delta in job.deltas():
            parts.append(delta)
    except _Stopped as e:
        raise ApiError(503, f"the reply stopped: {e}", kind="server_error") from None
    except Exception as e:
        logger.exception("reply %s failed", reply.id)
        raise ApiError(500, f"{type(e).__name__}: {e}", kind="server_error") from None
    finally:
        job.close()
    return reply.whole("".join(parts), job.stats)


# ---- the app -----------------------------------------------------------------------------------------------


def create_app(
    chat: Chat, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> fastapi.FastAPI:
    """The OpenAI-compatible app serving `chat` under `model_name`.

    Args:
      chat: the model, tokenizer and template (its `max_context` bounds prompt + max_tokens).
      model_name: the id clients name in `model` (and `GET /v1/models` lists).
      default_max_tokens: max_tokens of a request that gives none (less where the context has less room).
    """
    service = _Service(chat, model_name, default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI):
        yield
        service.stop_all("the server is shutting down")
        await asyncio.to_thread(service.worker.stop, SHUTDOWN_GRACE_S)
        service.readers.shutdown(wait=False, cancel_futures=True)

    app = fastapi.FastAPI(title="hybridlm", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):  # unknown paths, wrong methods
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    entry = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "hybridlm"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [entry]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        service.check_model(name)
        return entry

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
        service.check_model(body.model)
        messages = [m.for_template() for m in body.messages]
        thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else False
        try:
            ids, history = await asyncio.to_thread(
                chat.prompt_with_history, messages, enable_thinking=thinking
            )
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _answer(service, ids, body, max_tokens, request, chat=True, history=history)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request):
        service.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a list of one text (the validator refuses more)
        ids = await asyncio.to_thread(chat.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await _answer(service, ids, body, body.max_tokens, request, chat=False)

    return app


async def _answer(service: _Service, ids, body: _Request, max_tokens, request, *, chat: bool, history=None):
    """The response to a validated request: a stream of events, or the whole reply."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reply = _Reply(chat, service.model_name, include_usage and body.stream)
    job = service.start(ids, body, max_tokens, request, history)
    if body.stream:
        return _EventStream(reply.events(job), job)
    return await _whole(reply, job)


class _Server(uvicorn.Server):
    """uvicorn's server, which first ends the replies in flight when told to stop (Ctrl-C, SIGTERM): its
    graceful shutdown waits for open requests, and a long reply would hold it."""

    def __init__(self, config: uvicorn.Config, service: _Service):
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets=None) -> None:
        self.service.stop_all("the server is shutting down")
        await super().shutdown(sockets=sockets)


def make_server(
    chat: Chat,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    log_level: str = "info",
) -> uvicorn.Server:
    """A uvicorn server of `create_app(chat, model_name)` on host:port; `.run()` serves until stopped
    (`should_exit`, or Ctrl-C / SIGTERM in the main thread), ending the replies in flight first."""
    app = create_app(chat, model_name, default_max_tokens=default_max_tokens)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    return _Server(config, app.state.service)


def run_server(
    chat: Chat,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> None:
    """Serves `chat` as `model_name` on host:port until Ctrl-C or SIGTERM (uvicorn's handling: open requests
    end, then the signal is raised again, so Ctrl-C ends in KeyboardInterrupt)."""
    make_server(chat, model_name, host=host, port=port, default_max_tokens=default_max_tokens).run()
