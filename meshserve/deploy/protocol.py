"""OpenAI API request bodies (the subset meshserve serves), as pydantic models.

Request models reject unknown types and out-of-range values before anything reaches an engine;
``sampling_params`` turns a valid request into engine ``SamplingParams``. Responses are plain dicts
(``responses.py``): validating what the server itself builds would cost a model per stream chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from meshserve.contracts.sampling import MAX_LOGPROBS, SamplingParams
from meshserve.contracts.structured import StructuredOutputParams

# Sampling fields a request may leave unset, and the value each then takes when the model ships
# no default of its own (vLLM's neutral defaults).
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# Structured-output fields, read by meshserve.structured.openai.constraint_from_request.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")

MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 64  # each is checked against every token the sequence generates
MAX_N = 16

# Fields of OpenAI's API or vLLM's that meshserve does not implement, and the values that ask
# for nothing. Left out or at one of those, a field passes; set to anything else, the request
# fails naming it, instead of being answered as if the field were not there.
UNSUPPORTED = {"logit_bias": ({},), "min_tokens": (0,), "bad_words": ([],),
               "allowed_token_ids": (), "use_beam_search": (False,)}


def _reject_unsupported(name: str, value: Any, neutral: tuple, but: str = "") -> Any:
    if value is not None and value not in neutral:
        raise ValueError(f"meshserve does not support {name}{but}")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    # None: the model's generation default (or the neutral one), as in vLLM.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension, used by benchmarks
    # vLLM's extras for how a sequence ends and reads.
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Any = None
    min_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    use_beam_search: Any = None
    # Structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extra: the logprobs of each prompt token (and the top k at its position).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _check_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _reject_unsupported(info.field_name, value, UNSUPPORTED[info.field_name])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STRUCTURED_FIELDS}

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: Mapping[str, float | int] | None = None,
                        structured: StructuredOutputParams | None = None) -> SamplingParams:
        """The engine's params; a field the request leaves unset takes ``defaults`` (the model's
        generation defaults), else the neutral value."""
        unset = {name: (defaults or {}).get(name, neutral) for name, neutral in NEUTRAL.items()
                 if getattr(self, name) is None}
        given = {name: getattr(self, name) for name in NEUTRAL if name not in unset}
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.wanted_prompt_logprobs(), structured_outputs=structured,
            **unset, **given)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI caps completions logprobs at 5
    echo: bool = False
    suffix: Any = None
    best_of: Any = None

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: Any) -> Any:
        return _reject_unsupported("suffix", value, ("",))

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: Any, info: ValidationInfo) -> Any:
        # best_of equal to n asks for nothing more than n does.
        return _reject_unsupported("best_of", value, (1, info.data.get("n", 1)),
                                   but=" other than n")

    def wanted_prompt_logprobs(self) -> int | None:
        # Echo with logprobs returns the prompt's tokens with theirs, as OpenAI's API does.
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if k is not None]
        return max(wanted) if wanted else None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("token-id prompts must not be empty")
        if isinstance(value, list) and any(isinstance(p, str) and not p for p in value):
            raise ValueError("prompt strings must not be empty")
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
