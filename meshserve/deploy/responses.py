"""From requests to token ids, and from choice events to OpenAI responses and stream chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from meshserve.contracts.tokens import TokenLogprobs
from meshserve.deploy.choices import ChoiceEvent, ChoiceRunner
from meshserve.deploy.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                       ChatLogprobs, ChatMessage, ChatResponseMessage,
                                       ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                                       CompletionRequest, CompletionResponse, TopLogprob, Usage,
                                       new_id, now)


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


def _usage(runner: ChoiceRunner) -> Usage:
    prompt, completion = runner.prompt_tokens, runner.completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


class CompletionView:
    """``/v1/completions`` in both shapes: one response, or a stream of chunks."""

    def __init__(self, body: CompletionRequest, model: str, runner: ChoiceRunner) -> None:
        self.body, self.model, self.runner = body, model, runner
        self.id, self.created = new_id("cmpl"), now()

    def _logprobs(self, tokens: list[int], logprobs: list[TokenLogprobs],
                  offset: int) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        decode = self.runner.decode_token
        out = CompletionLogprobs()
        for token, (sampled, top_ids, top_lps) in zip(tokens, logprobs):
            text = decode(token)
            out.tokens.append(text)
            out.token_logprobs.append(sampled)
            out.top_logprobs.append({decode(t): lp for t, lp in zip(top_ids, top_lps)})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _echo(self, index: int) -> str:
        if not self.body.echo:
            return ""
        choice = self.runner.choices[index]
        return self.runner.tokenizer.decode(choice.prompt_token_ids)

    def final(self, runner: ChoiceRunner) -> CompletionResponse:
        choices = []
        for c in runner.choices:
            prefix = self._echo(c.index)
            choices.append(CompletionChoice(
                index=c.index, text=prefix + c.text, finish_reason=c.finish_reason,
                logprobs=self._logprobs(c.token_ids, c.logprobs, len(prefix))))
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=_usage(runner))

    async def chunks(self, runner: ChoiceRunner) -> AsyncIterator[str]:
        offsets = {c.index: 0 for c in runner.choices}
        if self.body.echo:
            for c in runner.choices:
                prefix = self._echo(c.index)
                offsets[c.index] = len(prefix)
                yield self._chunk(CompletionChoice(index=c.index, text=prefix))
        async for event in runner.events():
            logprobs = self._logprobs(event.token_ids, event.logprobs, offsets[event.index])
            offsets[event.index] += len(event.text)
            if event.text or event.finish_reason or logprobs:
                yield self._chunk(CompletionChoice(index=event.index, text=event.text,
                                                   logprobs=logprobs,
                                                   finish_reason=event.finish_reason))
        if self.body.include_usage:
            yield CompletionResponse(id=self.id, created=self.created, model=self.model,
                                     choices=[], usage=_usage(runner)).model_dump_json()

    def _chunk(self, choice: CompletionChoice) -> str:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[choice]).model_dump_json(exclude={"usage"})


class ChatView:
    """``/v1/chat/completions`` in both shapes."""

    def __init__(self, body: ChatCompletionRequest, model: str, runner: ChoiceRunner) -> None:
        self.body, self.model, self.runner = body, model, runner
        self.id, self.created = new_id("chatcmpl"), now()

    def _logprobs(self, tokens: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        decode = self.runner.decode_token

        def entry(token: int, lp: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [ChatTokenLogprob(**entry(token, sampled),
                                    top_logprobs=[TopLogprob(**entry(t, lp))
                                                  for t, lp in zip(top_ids, top_lps)])
                   for token, (sampled, top_ids, top_lps) in zip(tokens, logprobs)]
        return ChatLogprobs(content=content)

    def final(self, runner: ChoiceRunner) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs),
                              finish_reason=c.finish_reason) for c in runner.choices]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=choices, usage=_usage(runner))

    async def chunks(self, runner: ChoiceRunner) -> AsyncIterator[str]:
        for c in runner.choices:  # the role comes first, once per choice
            yield self._chunk(ChatChunkChoice(index=c.index,
                                              delta=ChatDelta(role="assistant", content="")))
        async for event in runner.events():
            yield self._event_chunk(event)
        if self.body.include_usage:
            yield ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                      choices=[], usage=_usage(runner)).model_dump_json()

    def _event_chunk(self, event: ChoiceEvent) -> str:
        delta = ChatDelta(content=event.text) if event.text else ChatDelta()
        return self._chunk(ChatChunkChoice(index=event.index, delta=delta,
                                           logprobs=self._logprobs(event.token_ids,
                                                                   event.logprobs),
                                           finish_reason=event.finish_reason))

    def _chunk(self, choice: ChatChunkChoice) -> str:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=[choice]).model_dump_json(exclude={"usage"})
