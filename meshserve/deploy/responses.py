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
from meshserve.structured.tools import (ToolCallStream, ToolPlan, call_dicts, forced_calls,
                                        parse_hermes)


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


def chat_prompt(messages: list[ChatMessage], tokenizer, tools: list | None = None) -> list[int]:
    rendered = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    # A template that defines a tool format renders the tools; others ignore them.
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True,
                                        **extra)
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

    def _prompt_logprobs(self, index: int) -> dict | None:
        """Echo with logprobs: the prompt's own tokens in the same shape, the first without a
        logprob (nothing comes before it), as OpenAI's API returns them."""
        choice = self.runner.choices[index]
        if not self.body.echo or self.body.logprobs is None or choice.prompt_logprobs is None:
            return None
        prompt, decode = choice.prompt_token_ids, self.runner.decode_token
        first = decode(prompt[0])
        k = self.body.logprobs
        rest = [(sampled, top_ids[:k], top_lps[:k])
                for sampled, top_ids, top_lps in choice.prompt_logprobs]
        out = self._logprobs(prompt[1:], rest, len(first))
        return {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
                "top_logprobs": [None] + out["top_logprobs"],
                "text_offset": [0] + out["text_offset"]}

    def _echo(self, index: int) -> str:
        if not self.body.echo:
            return ""
        return self.runner.tokenizer.decode(self.runner.choices[index].prompt_token_ids)

    def final(self, runner: ChoiceRunner) -> dict:
        choices = []
        for c in runner.choices:
            prefix = self._echo(c.index)
            logprobs = _joined(self._prompt_logprobs(c.index),
                               self._logprobs(c.token_ids, c.logprobs, len(prefix)))
            choice = {"index": c.index, "text": prefix + c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(runner, c,
                                                                 self.body.prompt_logprobs)
            choices.append(choice)
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
        prompt_sent: set[int] = set()
        async for event in runner.events():
            logprobs = None
            if want_logprobs:
                logprobs = self._logprobs(event.token_ids, event.logprobs, offsets[event.index])
                if event.index not in prompt_sent:  # the echoed prompt's, ahead of the first
                    prompt_sent.add(event.index)
                    logprobs = _joined(self._prompt_logprobs(event.index), logprobs)
            offsets[event.index] += len(event.text)
            if event.text or event.finish_reason or logprobs:
                yield chunk(_ending({"index": event.index, "text": event.text,
                                     "logprobs": logprobs}, event, event.finish_reason))
        if self.body.include_usage:
            yield self.envelope.usage_chunk(runner)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatView:
    """``/v1/chat/completions`` in both shapes.

    With ``tools``, ``plan`` says whether calls were forced (``required`` or a named function:
    the output is the calls) or left to the model (``auto``: read in the chat template's own
    format when it has one, ``hermes``); a reply with calls finishes with ``tool_calls``.
    """

    def __init__(self, body: ChatCompletionRequest, model: str, runner: ChoiceRunner,
                 plan: ToolPlan | None = None, hermes: bool = False) -> None:
        self.body, self.runner = body, runner
        self.plan, self.hermes = plan, hermes
        self.envelope = _Envelope.new("chatcmpl", "chat.completion", model)
        self.chunk_envelope = _Envelope({**self.envelope.fields,
                                         "object": "chat.completion.chunk"})
        self._streams: dict[int, ToolCallStream] = {}

    @property
    def _reads_calls(self) -> bool:
        forced = self.plan is not None and self.plan.constraint is not None
        return forced or (self.hermes and self.plan is not None and self.plan.mode == "auto")

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if not self._reads_calls:
            return {"role": "assistant", "content": text}, finish_reason
        if self.plan.constraint is not None:
            content, calls = None, forced_calls(self.plan, text)
        else:
            content, calls = parse_hermes(text)
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = call_dicts(calls, [_call_id() for _ in calls])
        return message, _with_calls(finish_reason, bool(calls))

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
        choices = []
        for c in runner.choices:
            message, finish_reason = self._message(c.text, c.finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        response = {**self.envelope.fields, "choices": choices, "usage": _usage(runner)}
        if self.body.prompt_logprobs is not None:  # vLLM puts the chat prompt's at the top
            response["prompt_logprobs"] = vllm_prompt_logprobs(runner, runner.choices[0],
                                                               self.body.prompt_logprobs)
        return response

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
        delta: dict[str, Any] = {"role": None, "content": event.text or None}
        finish_reason = event.finish_reason
        if self._reads_calls:
            stream = self._streams.get(event.index)
            if stream is None:
                stream = self._streams[event.index] = ToolCallStream(self.plan, self.hermes,
                                                                     _call_id)
            content, calls = stream.feed(event.text, finish_reason is not None)
            delta["content"] = content or None
            if calls:
                delta["tool_calls"] = calls
            if finish_reason is not None:
                finish_reason = _with_calls(finish_reason, bool(stream.calls))
        return _ending({"index": event.index, "delta": delta,
                        "logprobs": self._logprobs(event.token_ids, event.logprobs)},
                       event, finish_reason)


def _ending(choice: dict, event: ChoiceEvent, finish_reason: str | None) -> dict:
    """A streamed choice with its finish reason; the chunk that ends the choice also carries
    vLLM's ``stop_reason``, which the others leave out."""
    choice["finish_reason"] = finish_reason
    if event.finish_reason is not None:
        choice["stop_reason"] = event.stop_reason
    return choice


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two runs of completions logprobs as one (the echoed prompt's, then the generated)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(runner: ChoiceRunner, choice, k: int) -> list | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each token a map
    from token id (as text) to its logprob, rank and text: the prompt's own token and the top k
    at its position."""
    if choice.prompt_logprobs is None:
        return None
    decode = runner.decode_token
    out: list = [None]
    for token, (lp, top_ids, top_lps) in zip(choice.prompt_token_ids[1:],
                                             choice.prompt_logprobs):
        entries = {str(t): {"logprob": v, "rank": rank, "decoded_token": decode(t)}
                   for rank, (t, v) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1)}
        if str(token) not in entries:
            entries[str(token)] = {"logprob": lp, "rank": 1 + sum(v > lp for v in top_lps[:k]),
                                   "decoded_token": decode(token)}
        out.append(entries)
    return out


def _with_calls(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason for a reply that ended by itself with tool calls in it."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
