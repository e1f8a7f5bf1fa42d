"""The persistent batch: the runner's own copy of every running request, kept in numpy rows.

Rows persist across steps so that a decode step only touches what changed (one new token, maybe a
new block). Finished requests leave holes; ``condense`` moves the last rows into them so rows
``0..num_reqs-1`` are always dense and can be sliced without gathers.
"""

from __future__ import annotations

import bisect

import numpy as np

from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.step import NewRequestData


class InputBatch:
    def __init__(self, max_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_reqs = max_reqs
        self.req_ids: list[str | None] = [None] * max_reqs
        self.index: dict[str, int] = {}
        self.params: list[SamplingParams | None] = [None] * max_reqs
        self.token_ids = np.zeros((max_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_reqs, dtype=np.int32)  # known tokens (prompt + sampled)
        self.num_prompt_tokens = np.zeros(max_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_reqs, dtype=np.int32)
        self.sample_index = np.zeros(max_reqs, dtype=np.int64)
        # Sampling parameters as columns, so the sampler's tensors are slices, not Python loops.
        self.temperature = np.zeros(max_reqs, dtype=np.float32)
        self.top_p = np.ones(max_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_reqs, dtype=np.float32)
        self._holes: list[int] = []
        self.num_reqs = 0

    def add(self, data: NewRequestData) -> int:
        """Put a request in the lowest free row. The lowest, not the first freed: a step's
        finished requests come as a set, whose order differs from process to process (string
        hashing is salted per process), and every host of a replica must lay out the same rows."""
        row = self._holes.pop(0) if self._holes else self.num_reqs
        if row >= self.max_reqs:
            raise RuntimeError(f"input batch is full ({self.max_reqs} requests)")
        self.num_reqs += 1
        self.req_ids[row] = data.request_id
        self.index[data.request_id] = row
        self.params[row] = data.params
        n = len(data.token_ids)
        self.token_ids[row, :n] = data.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, data.block_ids)
        self.sample_index[row] = data.sample_index
        p = data.params
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = max(p.top_k, 0)
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        return row

    def append_blocks(self, row: int, block_ids: tuple[int, ...]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, request_id: str) -> None:
        row = self.index.pop(request_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.params[row] = None
        bisect.insort(self._holes, row)
        self.num_reqs -= 1

    def condense(self) -> None:
        """Fill holes (kept sorted) with the last live rows so rows [0, num_reqs) are dense."""
        last = self.num_reqs + len(self._holes) - 1
        for hole in self._holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        self._holes.clear()

    def _move(self, src: int, dst: int) -> None:
        request_id = self.req_ids[src]
        assert request_id is not None
        self.req_ids[dst], self.req_ids[src] = request_id, None
        self.params[dst], self.params[src] = self.params[src], None
        self.index[request_id] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for column in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                       self.num_blocks, self.sample_index, self.temperature, self.top_p,
                       self.top_k, self.min_p, self.presence_penalty, self.frequency_penalty,
                       self.repetition_penalty):
            column[dst] = column[src]
