"""What one process has placed on the replicas of a deployment: the state its ``EngineRouter`` s
and its ``EngineClient`` share.

It is its own module because Serve copies the router's module into each caller by value; this one
is imported by name, so every router and client of a process meets the same ``LoadBook``.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable

from meshserve.actors.messages import GenerateSpec, direct_channel

FAILED_FOR_S = 30.0  # how long a replica whose stream broke is skipped by this process
# How long a finished sequence may still appear in a replica's load report (Serve polls the
# reports every second or so, and a poll can be in flight when the sequence ends).
REPORT_LAG_S = 10.0


class ReplicaGone(RuntimeError):
    """A call meant for one engine replica found it no longer serving; ``replica_id`` names it,
    so that a caller can skip it before Serve has noticed."""

    def __init__(self, message: str, replica_id: str) -> None:
        super().__init__(message)
        self.replica_id = replica_id

    def __reduce__(self):  # travels inside Ray's task errors
        return type(self), (str(self), self.replica_id)


class LoadBook:
    """This process's view of what it has placed on each replica of one deployment."""

    def __init__(self) -> None:
        self.caller_id = uuid.uuid4().hex[:16]  # how replicas tell this process's load apart
        self._clients = itertools.count()
        self._lock = threading.Lock()  # the router may run on its own event loop thread
        self._held: dict[str, tuple[str, int]] = {}  # sequence id -> (replica id, tokens)
        self._owed: dict[str, int] = {}
        # Direct channel of every sequence placed here: those running, and those finished ->
        # until when a replica's load report may still carry them (in order of that time).
        self._running: set[str] = set()
        self._finished: dict[str, float] = {}
        self._failed: dict[str, float] = {}
        self.replica_ids: frozenset[str] = frozenset()  # what this process's routers see
        # The newest router's choice of replica for a sequence (``EngineRouter.place``); None
        # until this process's first call through a handle has started one.
        self.placer: Callable[[GenerateSpec], str | None] | None = None

    def new_channel(self) -> str:
        """A channel of this process for one client: a host's channel has one reader (its output
        stream), so two clients of one process (two event loops, or one after another) each
        need their own; replicas report load per channel, and ``others`` knows these as ours."""
        return f"{self.caller_id}.{next(self._clients)}"

    def hold(self, key: str, replica_id: str, tokens: int) -> None:
        """Count ``tokens`` against ``replica_id`` for sequence ``key`` (moving it if held)."""
        with self._lock:
            self._release(key)
            self._held[key] = (replica_id, tokens)
            self._running.add(direct_channel(key))
            self._owed[replica_id] = self._owed.get(replica_id, 0) + tokens

    def release(self, key: str) -> None:
        with self._lock:
            self._release(key)

    def _release(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._owed[held[0]] -= held[1]
            channel = direct_channel(key)
            self._running.discard(channel)
            self._finished.pop(channel, None)
            self._finished[channel] = time.monotonic() + REPORT_LAG_S

    def owed(self, replica_id: str) -> int:
        return self._owed.get(replica_id, 0)

    def others(self, reported: dict[str, int]) -> int:
        """Tokens in a replica's per-channel load report that other processes owe: without this
        process's clients' channels, or the direct channel of any sequence it placed (``owed``
        counts those still running exactly; a stale report must not count one twice, or one
        that has finished)."""
        now = time.monotonic()
        with self._lock:
            while self._finished and next(iter(self._finished.values())) <= now:
                del self._finished[next(iter(self._finished))]
            return sum(tokens for channel, tokens in reported.items()
                       if channel.partition(".")[0] != self.caller_id
                       and channel not in self._running
                       and channel not in self._finished)

    def mark_failed(self, replica_id: str) -> None:
        self._failed[replica_id] = time.monotonic() + FAILED_FOR_S

    def failed(self, replica_id: str) -> bool:
        until = self._failed.get(replica_id)
        return until is not None and time.monotonic() < until


_BOOKS: dict[tuple[str, str], LoadBook] = {}
_BOOKS_LOCK = threading.Lock()


def load_book(app_name: str, deployment_name: str) -> LoadBook:
    """The one ``LoadBook`` of this process for a deployment (its routers and clients share it)."""
    with _BOOKS_LOCK:
        return _BOOKS.setdefault((app_name, deployment_name), LoadBook())


def sequence_cost(spec: GenerateSpec) -> int:
    return len(spec.prompt_token_ids) + spec.params.max_tokens


def spec_of(request) -> GenerateSpec | None:
    """The sequence a call carries: ``generate(spec)``, ``generate_stream(spec)`` or
    ``submit(channel, spec)``."""
    return next((a for a in request.args[:2] if isinstance(a, GenerateSpec)), None)
