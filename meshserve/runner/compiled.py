"""One piece of the step, compiled at warm-up and then called without dynamo.

``torch.compile`` checks guards on every call and re-traces when one fails. A serving step has no
use for either once warm-up has compiled every shape it can see: the runner knows which shape it
is about to run. So, after the seed's custom dispatcher, a ``CompiledPiece`` compiles its function
at warm-up for each dispatch key (a token bucket on xla; one dynamic-shape program on cpu),
captures the bytecode dynamo produces for it (a bytecode hook), and from then on calls that
bytecode directly, as a plain function over the same globals: no guard evaluation, no frame
conversion, no tracing. What dynamo specialised on at warm-up must then hold at every call, which
is why the step's pieces take only tensors and constants fixed per key, and why dynamic pieces are
warmed up at two unrelated sizes (``warm_up`` refuses a program that does not cover both).

``eager=True`` (``LLM(enforce_eager=True)``) calls the function itself: lazy tracing on xla, eager
torch on cpu.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

# Recompilations dynamo allows per function before it gives up compiling it. Warm-up compiles
# one program per key on purpose, and a step has dozens of keys on xla.
_RECOMPILE_LIMIT = 4096


class CompiledPiece:
    def __init__(self, fn: Callable[..., Any], *, backend: str, dynamic: bool, eager: bool,
                 options: dict[str, Any] | None = None,
                 cut: Callable[[], None] | None = None) -> None:
        self.eager = eager
        # Run after each eager call: on xla it ends the lazily traced graph here, so each piece
        # stays a graph of its own (one per shape) rather than merging into its successor.
        self._cut = cut
        self.dynamic = dynamic
        self._self = getattr(fn, "__self__", None)  # the module of a bound forward, else None
        # A code object of this piece's own: dynamo caches programs per code object, and
        # another runner's program for the same method must never pass this one's guards (with
        # frozen weights it would compute with the other model's weights).
        shared = getattr(fn, "__func__", fn)
        self._function = types.FunctionType(shared.__code__.replace(), shared.__globals__,
                                            shared.__name__, shared.__defaults__,
                                            shared.__closure__)
        self.fn = (self._function if self._self is None
                   else types.MethodType(self._function, self._self))
        self._programs: dict[Hashable, Callable[..., Any]] = {}
        self._captured: list[types.CodeType] | None = None
        self._compiled = None
        self._options = dict(options or {})
        if not eager:
            self._compiled = torch.compile(self.fn, backend=backend, dynamic=dynamic,
                                           fullgraph=True, options=options)

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    def warm_up(self, key: Hashable, *args: Any) -> Any:
        """Compile for ``key`` by calling with ``args``; returns the result of that call."""
        if self.eager:
            return self._eager(args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len({id(t) for t in tensors}) < len(tensors):
            # dynamo would compile a program that reads one input for both; called directly,
            # with no guard to notice, it would then ignore the second tensor of every step.
            raise ValueError(f"{self._function.__qualname__}: warm-up passed one tensor as two "
                             "arguments")
        if self.dynamic and self._programs:
            # One program serves every size: prove it on these sizes before trusting it.
            (program,) = self._programs.values()
            captured, out = self._capture(args)
            if captured:
                raise RuntimeError(
                    f"{self._function.__qualname__}: sizes {_shapes(args)} needed a second "
                    "program; a dynamic piece must compile once")
            self._programs[key] = program
            return out
        captured, out = self._capture(args)
        if len(captured) != 1:
            raise RuntimeError(
                f"{self._function.__qualname__}: warm-up for {key!r} produced {len(captured)} "
                "programs, expected 1 (was the key already compiled, or did the graph break?)")
        self._programs[key] = types.FunctionType(
            captured[0], self._function.__globals__, self._function.__name__,
            self._function.__defaults__, self._function.__closure__)
        return out

    def _capture(self, args: tuple[Any, ...]) -> tuple[list[types.CodeType], Any]:
        import torch._dynamo
        import torch._inductor.config

        hook = torch._dynamo.convert_frame.register_bytecode_hook(self._on_bytecode)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
        self._captured = []
        try:
            # Set for the whole capture, not only through torch.compile's options: dynamo reads
            # inductor's freezing flag itself, to keep the weights out of the graph's inputs.
            with torch._inductor.config.patch(self._options):
                out = self._compiled(*args)
            return self._captured, out
        finally:
            self._captured = None
            hook.remove()
            torch._dynamo.config.recompile_limit = limit

    def _on_bytecode(self, old: types.CodeType, new: types.CodeType) -> None:
        if self._captured is not None and old is self._function.__code__:
            self._captured.append(new)

    def __call__(self, key: Hashable, *args: Any) -> Any:
        """Run the program warm-up compiled for ``key`` (a KeyError means warm-up missed it)."""
        if self.eager:
            return self._eager(args)
        program = self._programs[key]
        return program(*args) if self._self is None else program(self._self, *args)

    def _eager(self, args: tuple[Any, ...]) -> Any:
        out = self.fn(*args)
        if self._cut is not None:
            self._cut()
        return out


def _shapes(args: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
