"""Grammars compiled against the model's vocabulary, once each, on a worker thread.

Compiling precomputes which tokens each grammar state accepts: milliseconds for a small schema,
seconds for a large one. It runs on a worker thread (xgrammar releases the GIL while it compiles,
so the step loop keeps its pace) and each result is cached by the constraint's key, so a request
repeating a schema reuses it at once. The parse that rejects invalid input runs on the caller's
thread first (``grammar.build_grammar``), so a bad request fails where it is added.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from meshserve.contracts.structured import StructuredOutputParams
from meshserve.structured.grammar import build_grammar

logger = logging.getLogger("meshserve.structured")

# Compiled grammars kept for reuse; the least recently used beyond this are dropped.
CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles ``StructuredOutputParams`` for one tokenizer; ``submit`` returns a future."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        # vocab_size is the model's (its logits' width), which may exceed the tokenizer's.
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # One thread here and one inside xgrammar: compilation never takes every core from the
        # step loop.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshserve-grammar")
        self._cache: OrderedDict[tuple, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # submit may be called from several threads (host actors)

    def submit(self, params: StructuredOutputParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params``, soon; an invalid constraint raises
        ``StructuredOutputError`` here and now."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(params)  # outside the lock: it may take a few milliseconds
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, grammar, params.kind)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            return future

    def _compile(self, grammar: xgr.Grammar, kind: str) -> xgr.CompiledGrammar:
        started = time.perf_counter()
        compiled = self._compiler.compile_grammar(grammar)
        logger.debug("compiled a %s grammar in %.3fs", kind, time.perf_counter() - started)
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
