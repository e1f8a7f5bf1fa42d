"""Reading an output channel: an ``asyncio.Queue`` of batches, where a failure is posted in-band.

Producers (a host's event loop, an ``EngineClient``'s pump) put lists of token deltas, a
``SequenceError`` where one sequence ended in an error, or a list holding one exception when the
whole source failed. A reader takes whatever is ready in one go, so a slow reader gets fewer,
larger batches instead of falling behind one message per step.
"""

from __future__ import annotations

import asyncio

from meshserve.contracts.tokens import TokenDelta


async def next_batch(channel: asyncio.Queue) -> list[TokenDelta]:
    """Wait for a batch, append every batch already queued behind it, and return them as one.

    An exception found among the items is raised instead: whatever came with it is moot.
    """
    batch = list(await channel.get())
    while not channel.empty():
        batch.extend(channel.get_nowait())
    failure = next((item for item in batch if isinstance(item, BaseException)), None)
    if failure is not None:
        raise failure
    return batch
