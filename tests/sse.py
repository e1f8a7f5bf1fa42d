"""An OpenAI stream as the tests read it: the event of each ``data:`` line, in order.

The benchmark's client parses raw bytes (``meshserve.benchmark.stream``); the tests read lines
from httpx, which has already split them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

DONE = "[DONE]"  # the last event of a stream that ended normally

Event = dict[str, Any] | str  # a chunk (or an error event), or DONE


def sse_event(line: str) -> Event | None:
    """The event on one line of a stream, or None for a line that carries none (the blank line
    after each event)."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: "):]
    return DONE if data == DONE else json.loads(data)


def sse_events(lines: Iterable[str]) -> Iterator[Event]:
    """The events on a stream's lines, in order."""
    for line in lines:
        event = sse_event(line)
        if event is not None:
            yield event
