"""The OpenAI-compatible HTTP ingress: a FastAPI app served as a Ray Serve deployment.

It validates requests (pydantic), renders chat templates, tokenizes, hands token ids to the engine
replicas (``EngineClient``: its handle's ``EngineRouter`` picks a replica per sequence), and turns
what comes back into OpenAI responses or server-sent events. It runs as several replicas
(``ingress_replicas``), each with its own tokenizer and its own streams from the engines; none
holds state another needs. Given a ``listen`` address (``meshserve serve`` does) each replica
answers HTTP there itself (``IngressListener``); otherwise Serve's proxy passes requests in.
Every error leaves in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; bad
input is a 4xx, never a 500, and never carries a stack trace.
"""

# No "from __future__ import annotations": FastAPI must see real types on the route methods.
import asyncio
import hmac
import json
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshserve.actors.messages import (HostInfo, RequestRejected, RouterOverloaded,
                                       ServerDraining)
from meshserve.contracts.prompt import PromptError
from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.structured import StructuredOutputError, StructuredOutputParams
from meshserve.deploy import responses
from meshserve.deploy.choices import ChoiceRunner
from meshserve.deploy.client import EngineClient
from meshserve.deploy.listener import IngressListener
from meshserve.deploy.loopback import bind_serve_grpc_to_node_ip
from meshserve.deploy.metrics import ServingMetrics
from meshserve.deploy.protocol import ChatCompletionRequest, CompletionRequest
from meshserve.deploy.settings import ServeSettings
from meshserve.logs import configure_process_logging
from meshserve.runner.loader import generation_defaults, load_tokenizer
from meshserve.structured.openai import constraint_from_request
from meshserve.structured.tools import ToolPlan, plan_tools, template_tool_format

logger = logging.getLogger("meshserve.ingress")
bind_serve_grpc_to_node_ip()

app = FastAPI(title="meshserve", docs_url=None, redoc_url=None)
LOADED_WAIT_S = 2.0  # how long a request waits for the engines' first answer before a 503
INFO_REASK_S = 15.0  # how long that first question may go unanswered before it is asked again
REPLICA_HEADER = "x-meshserve-ingress"
LISTENER_SHUTDOWN_S = 5.0  # responses in flight when a replica stops get this long to finish
_UNION_TAG = re.compile(r"str|int|float|bool|[a-z_-]+\[.*\]|function-.*")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.kind, exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    # Drop "body" and the union-branch tags pydantic adds ("str", "list[int]"): the param is a
    # field.
    location = [str(p) for p in first.get("loc", ())
                if p != "body" and not _UNION_TAG.fullmatch(str(p))]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", None)
    message = first.get("msg", "invalid request")
    return error_response(400, f"{param}: {message}" if param else message, param)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), None, kind)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error")
    return error_response(500, "internal error", None, "internal_error")


# PJRT_DEVICE: the ingress never computes; torch_xla, which its imports load, must not look for
# (or claim) an accelerator.
INGRESS_ACTOR_OPTIONS = {"num_cpus": 0, "runtime_env": {"env_vars": {"PJRT_DEVICE": "CPU"}}}


@serve.deployment(name="OpenAIIngress", num_replicas=1, ray_actor_options=INGRESS_ACTOR_OPTIONS,
                  max_ongoing_requests=10_000, graceful_shutdown_wait_loop_s=0.5,
                  graceful_shutdown_timeout_s=10)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, settings: ServeSettings,
                 listen: tuple[str, int] | None = None) -> None:
        configure_process_logging()
        settings.lower_priority()
        self.engine = EngineClient(engine)
        # Which ingress replica answered: operators (and tests) can tell the replicas apart.
        self.headers = {REPLICA_HEADER: serve.get_replica_context().replica_id.unique_id}
        self.settings = settings
        self.model_name = settings.model_name()
        self.tokenizer = load_tokenizer(settings.engine.model)
        # A field a request leaves unset takes the model's default, as the engines' do.
        self.generation_defaults = (generation_defaults(settings.engine.model)
                                    if settings.engine.generation_config == "auto" else {})
        self.tool_format = template_tool_format(self.tokenizer.chat_template)
        self.api_key = settings.resolved_api_key()
        self.metrics = ServingMetrics()
        self._info_task: asyncio.Task | None = None
        self._info_asked_at = 0.0
        # Last: requests may arrive as soon as it listens.
        self.listener = None if listen is None else IngressListener(app, *listen,
                                                                    LISTENER_SHUTDOWN_S)

    async def __del__(self) -> None:
        # Serve calls (and awaits) this when it stops the replica; the constructor may not
        # have got as far as the listener.
        listener = getattr(self, "listener", None)
        if listener is not None:
            await listener.close()

    # ------------------------------------------------------------------ plumbing
    async def _loaded(self, wait_s: float) -> HostInfo | None:
        """The engines' model limits once some engine replica serves, else None after waiting
        at most ``wait_s`` (the question stays asked in the background)."""
        now = time.monotonic()
        if self._info_task is not None and not self._info_task.done() \
                and now - self._info_asked_at > INFO_REASK_S:
            # Asked while no engine replica ran yet, a call has been seen to wait on after one
            # came up (the server said ready, /health stayed 503): ask afresh now and then.
            self._info_task.cancel()
            self._info_task = None
        if self._info_task is None:
            self._info_task = asyncio.ensure_future(self.engine.handle.info.remote())
            self._info_asked_at = now
        await asyncio.wait([self._info_task], timeout=wait_s)
        if not self._info_task.done():
            return None
        # A failed question is asked again next time, and so is a cancelled one: its
        # .exception() raises CancelledError, a BaseException no route handler catches, so
        # keeping it would fail every later request of this replica.
        if self._info_task.cancelled() or self._info_task.exception() is not None:
            self._info_task = None
            return None
        return self._info_task.result()

    async def _model_info(self) -> HostInfo:
        info = await self._loaded(LOADED_WAIT_S)
        if info is None:
            raise APIError(503, "the model is still loading", kind="service_unavailable")
        return info

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key", kind="authentication_error")

    async def _body(self, request: Request, model_class):
        self._authorize(request)
        declared = request.headers.get("content-length")
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes")
        raw = await request.body()
        if len(raw) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            body = model_class.model_validate(data)
        except Exception as exc:  # pydantic.ValidationError
            raise RequestValidationError(exc.errors()) from None
        if body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "not_found_error")
        return body

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int | None,
                       info: HostInfo) -> int:
        """Check the prompts and max_tokens against the model's limits, as its hosts would;
        return the effective max_tokens."""
        limits = info.prompt_limits
        try:
            for prompt in prompts:
                limits.check(prompt)
            return limits.max_tokens(max(len(p) for p in prompts), max_tokens)
        except PromptError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def _params(self, body, max_tokens: int, logprobs: int | None,
                plan: ToolPlan | None = None) -> SamplingParams:
        try:
            structured = self._constraint(body, plan)
            return body.sampling_params(max_tokens, logprobs, self.generation_defaults,
                                        structured)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), exc.param) from None
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ")[0]) from None

    @staticmethod
    def _constraint(body, plan: ToolPlan | None) -> StructuredOutputParams | None:
        """The request's structured-output constraint, or the one its forced tool calls need."""
        asked = constraint_from_request(body.structured_fields())
        if plan is None or plan.constraint is None:
            return asked
        if asked is not None:
            raise StructuredOutputError("tool_choice", f"{plan.mode} tool calls cannot be "
                                                       "combined with another output constraint")
        return plan.constraint

    async def _run(self, runner: ChoiceRunner, stream_fn, final_fn, stream: bool):
        try:
            await runner.start()
        except Exception as exc:
            error = self._translate(exc)
            self.metrics.requests.labels(status=str(error.status)).inc()
            raise error from None
        self.metrics.started()
        if stream:
            return StreamingResponse(self._sse(runner, stream_fn), media_type="text/event-stream",
                                     headers=self.headers)
        try:
            async for _ in runner.events():
                pass
        except Exception as exc:
            self.metrics.finished(runner, "error")
            raise self._translate(exc) from None
        self.metrics.finished(runner, "ok")
        return JSONResponse(final_fn(runner), headers=self.headers)

    async def _sse(self, runner: ChoiceRunner, stream_fn):
        status = "cancelled"
        try:
            async for chunk in stream_fn(runner):
                yield f"data: {chunk}\n\n"
            status = "ok"
        except Exception as exc:
            status = "error"
            err = self._translate(exc)
            body = {"error": {"message": err.message, "type": err.kind, "param": err.param,
                              "code": err.status}}
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            self.metrics.finished(runner, status)
        if status != "cancelled":
            yield "data: [DONE]\n\n"

    def _translate(self, exc: Exception) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, RouterOverloaded):
            return APIError(429, "the server is overloaded; retry later", None,
                            "rate_limit_error", {"Retry-After": "1"})
        if isinstance(exc, ServerDraining):
            return APIError(503, "the server is shutting down", kind="service_unavailable")
        if isinstance(exc, RequestRejected):
            return APIError(400, str(exc).splitlines()[-1], "prompt")
        logger.error("generation failed: %r", exc)
        return APIError(503, "generation failed on a model replica; retry the request", None,
                        "service_unavailable")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200 if await self._loaded(LOADED_WAIT_S) else 503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        # Every engine replica's counters (one that is restarting is left out meanwhile).
        replicas = await self.engine.each_replica("stats")
        return Response(self.metrics.render(replicas, self.settings.placement.num_replicas),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        info = await self._loaded(LOADED_WAIT_S)
        return JSONResponse(responses.model_list(
            self.model_name, None if info is None else info.max_model_len))

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body: CompletionRequest = await self._body(request, CompletionRequest)
        info = await self._model_info()
        prompts = responses.completion_prompts(body.prompt, self.tokenizer)
        max_tokens = self._check_lengths(prompts, body.max_tokens, info)
        runner = ChoiceRunner(self.engine, self.tokenizer, prompts,
                              self._params(body, max_tokens, body.logprobs))
        view = responses.CompletionView(body, self.model_name, runner)
        return await self._run(runner, view.chunks, view.final, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        info = await self._model_info()
        try:
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), exc.param) from None
        prompt = responses.chat_prompt(body.messages, self.tokenizer, body.tools)
        max_tokens = self._check_lengths([prompt], body.requested_max_tokens, info)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        runner = ChoiceRunner(self.engine, self.tokenizer, [prompt],
                              self._params(body, max_tokens, logprobs, plan))
        view = responses.ChatView(body, self.model_name, runner, plan,
                                  self.tool_format == "hermes")
        return await self._run(runner, view.chunks, view.final, body.stream)
