"""One constrained request's grammar state on the host: its matcher and its next mask.

The state is created when the request is added, with its grammar still compiling; the scheduler
admits the request once ``ready``. From then on it keeps the packed mask of the tokens allowed
next (``next_mask``), refilled right after each accepted token, so the step that samples the
request only copies it, and a grammar that allows nothing further is known at once: the token just
accepted is the request's last, with finish reason ``grammar``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np
import xgrammar as xgr

from meshserve.contracts.sampling import FinishReason

logger = logging.getLogger("meshserve.structured")


class GrammarState:
    """The matcher of one request (one sample of it: ``n`` samples each have their own)."""

    def __init__(self, compiled: Future[xgr.CompiledGrammar], closing_mask: np.ndarray) -> None:
        self.compiled = compiled
        # Allows only the stop tokens: what a request whose grammar allows nothing at all from
        # its start may sample, so that it ends at once (and with finish reason "grammar").
        self._closing_mask = closing_mask
        self._matcher: xgr.GrammarMatcher | None = None
        self._closing = False
        self._buffer = np.zeros((1, len(closing_mask)), dtype=np.int32)  # xgrammar fills rows
        self.next_mask = self._buffer[0]  # [W] int32, valid once ready
        self.finish_reason: FinishReason | None = None  # set when the grammar ends the request

    @property
    def ready(self) -> bool:
        """Whether the grammar has compiled (or failed to): the request may be scheduled."""
        if self._matcher is None and not self._closing:
            if not self.compiled.done():
                return False
            self._start()
        return True

    def _start(self) -> None:
        try:
            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        except Exception:  # a grammar that parsed but did not compile: end the request cleanly
            logger.exception("a structured-output grammar failed to compile")
            self._close()
            return
        if not self._refill():
            self._close()

    def _close(self) -> None:
        self._closing = True
        self.next_mask = self._closing_mask

    def _refill(self) -> bool:
        """Compute the mask of the next token; False when it allows none."""
        self._matcher.fill_next_token_bitmask(self._buffer)
        return bool(self.next_mask.any())

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one ``next_mask`` allowed)."""
        if self.finish_reason is not None:
            return
        if self._closing or not self._matcher.accept_token(token_id):
            # Only the stop tokens were allowed (the grammar admits nothing), or a token the mask
            # should have excluded: either way this grammar can take the request no further.
            self.finish_reason = FinishReason.GRAMMAR
        elif self._matcher.is_terminated():
            self.finish_reason = FinishReason.STOP  # a stop token completed the grammar
        elif not self._refill():
            self.finish_reason = FinishReason.GRAMMAR
