"""From requests to token ids, and from choice events to OpenAI responses and stream chunks.

Responses are built as plain dicts and rendered with ``json`` directly: a stream chunk is the
request's fixed envelope (id, object, created, model), rendered once, around one choice rendered
per event, so a token costs one small ``json.dumps`` and no model validation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from meshserve.contracts.tokens import TokenLogprobs
from meshserve.deploy.choices import ChoiceEvent, ChoiceRunner
from meshserve.deploy.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


def dumps(value: Any) -> str:
    """Compact JSON with text as UTF-8, not ``\\u`` escapes (as pydantic renders it)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """A str, list of str, token ids, or lists of token ids, as token-id lists."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def chat_prompt(messages: list[ChatMessage], tokenizer) -> list[int]:
    rendered = [{"role": m.role, "content": m.text()} for m in messages]
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def model_list(model: str, max_model_len: int | None) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": "meshserve", "max_model_len": max_model_len}]}


def _usage(runner: ChoiceRunner) -> dict:
    prompt, completion = runner.prompt_tokens, runner.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Envelope:
    """The fields every response and chunk of one request shares."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields
        self._head = dumps(fields)[:-1] + ',"choices":['

    @classmethod
    def new(cls, prefix: str, kind: str, model: str) -> "_Envelope":
        return cls({"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                    "created": int(time.time()), "model": model})

    def chunk(self, choice: dict) -> str:
        return self._head + dumps(choice) + "]}"

    def usage_chunk(self, runner: ChoiceRunner) -> str:
        return self._head + '],"usage":' + dumps(_usage(runner)) + "}"


class CompletionView:
    """``/v1/completions`` in both shapes: one response, or a stream of chunks."""

    def __init__(self, body: CompletionRequest, model: str, runner: ChoiceRunner) -> None:
        self.body, self.runner = body, runner
        self.envelope = _Envelope.new("cmpl", "text_completion", model)

    def _logprobs(self, tokens, logprobs: list[TokenLogprobs], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        decode = self.runner.decode_token
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token, (sampled, top_ids, top_lps) in zip(tokens, logprobs):
            text = decode(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(sampled)
            out["top_logprobs"].append({decode(t): lp for t, lp in zip(top_ids, top_lps)})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _echo(self, index: int) -> str:
        if not self.body.echo:
            return ""
        return self.runner.tokenizer.decode(self.runner.choices[index].prompt_token_ids)

    def final(self, runner: ChoiceRunner) -> dict:
        choices = []
        for c in runner.choices:
            prefix = self._echo(c.index)
            choices.append({"index": c.index, "text": prefix + c.text,
                            "logprobs": self._logprobs(c.token_ids, c.logprobs, len(prefix)),
                            "finish_reason": c.finish_reason})
        return {**self.envelope.fields, "choices": choices, "usage": _usage(runner)}

    async def chunks(self, runner: ChoiceRunner) -> AsyncIterator[str]:
        offsets = {c.index: 0 for c in runner.choices}
        chunk = self.envelope.chunk
        if self.body.echo:
            for c in runner.choices:
                prefix = self._echo(c.index)
                offsets[c.index] = len(prefix)
                yield chunk({"index": c.index, "text": prefix, "logprobs": None,
                             "finish_reason": None})
        want_logprobs = self.body.logprobs is not None
        async for event in runner.events():
            logprobs = None
            if want_logprobs:
                logprobs = self._logprobs(event.token_ids, event.logprobs, offsets[event.index])
            offsets[event.index] += len(event.text)
            if event.text or event.finish_reason or logprobs:
                yield chunk({"index": event.index, "text": event.text, "logprobs": logprobs,
                             "finish_reason": event.finish_reason})
        if self.body.include_usage:
            yield self.envelope.usage_chunk(runner)


class ChatView:
    """``/v1/chat/completions`` in both shapes."""

    def __init__(self, body: ChatCompletionRequest, model: str, runner: ChoiceRunner) -> None:
        self.body, self.runner = body, runner
        self.envelope = _Envelope.new("chatcmpl", "chat.completion", model)
        self.chunk_envelope = _Envelope({**self.envelope.fields,
                                         "object": "chat.completion.chunk"})

    def _logprobs(self, tokens, logprobs: list[TokenLogprobs]) -> dict | None:
        if not self.body.logprobs:
            return None
        decode = self.runner.decode_token

        def entry(token: int, lp: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(token, sampled),
                             "top_logprobs": [entry(t, lp) for t, lp in zip(top_ids, top_lps)]}
                            for token, (sampled, top_ids, top_lps) in zip(tokens, logprobs)]}

    def final(self, runner: ChoiceRunner) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason} for c in runner.choices]
        return {**self.envelope.fields, "choices": choices, "usage": _usage(runner)}

    async def chunks(self, runner: ChoiceRunner) -> AsyncIterator[str]:
        chunk = self.chunk_envelope.chunk
        for c in runner.choices:  # the role comes first, once per choice
            yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        async for event in runner.events():
            yield chunk(self._event_choice(event))
        if self.body.include_usage:
            yield self.chunk_envelope.usage_chunk(runner)

    def _event_choice(self, event: ChoiceEvent) -> dict:
        return {"index": event.index, "delta": {"role": None, "content": event.text or None},
                "logprobs": self._logprobs(event.token_ids, event.logprobs),
                "finish_reason": event.finish_reason}
