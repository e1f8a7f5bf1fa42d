"""Timing a streamed completion from its raw bytes: server-sent events in, a measurement out."""

from __future__ import annotations

import json
from typing import Any

from meshserve.benchmark.results import RequestResult


class SSEDecoder:
    """Incremental server-sent-events parser: bytes in any split, event data strings out.

    Bytes are buffered until a full line arrives, so a chunk boundary inside a multi-byte
    character or between ``\\r`` and ``\\n`` is harmless. Per the SSE spec, ``data:`` lines
    accumulate and a blank line dispatches them; other fields and comments are ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.removesuffix(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


class StreamTimer:
    """Times one streamed completion from its raw bytes: first text chunk, gaps, usage.

    Chunks without text (the usage-only chunk, a bare finish reason) are not tokens, so they
    neither set the TTFT nor add a gap.
    """

    def __init__(self, start: float) -> None:
        self._start = start
        self._decoder = SSEDecoder()
        self._chunk_times: list[float] = []
        self._usage: dict[str, Any] = {}
        self._error: str | None = None
        self._done = False

    def feed(self, chunk: bytes, now: float) -> None:
        for data in self._decoder.feed(chunk):
            if self._done or self._error:
                continue
            if data == "[DONE]":
                self._done = True
                continue
            event = json.loads(data)
            if "error" in event or event.get("object") == "error":
                self._error = f"error event: {json.dumps(event.get('error', event))[:300]}"
            elif any(choice.get("text") for choice in event.get("choices") or ()):
                self._chunk_times.append(now)
            self._usage = event.get("usage") or self._usage

    def result(self, end: float) -> RequestResult:
        e2e = end - self._start
        error = self._error or (None if self._done else "stream ended before data: [DONE]")
        if error:
            return RequestResult(ok=False, e2e=e2e, error=error)
        times = self._chunk_times
        return RequestResult(
            ok=True, e2e=e2e,
            ttft=times[0] - self._start if times else None,
            # Usage is exact; counting chunks is the fallback for servers that ignore
            # stream_options (it undercounts when a chunk carries several tokens).
            output_tokens=self._usage.get("completion_tokens", len(times)),
            prompt_tokens=self._usage.get("prompt_tokens"),
            itl=tuple(b - a for a, b in zip(times, times[1:])))
