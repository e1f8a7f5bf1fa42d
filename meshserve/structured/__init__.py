"""Structured output: outputs held to a JSON schema, a regex, a choice or a grammar, via xgrammar.

- ``grammar``: a constraint (``contracts.structured.StructuredOutputParams``) parsed into a
  grammar; where invalid input is refused, with the field named;
- ``compiler``: grammars compiled against the vocabulary on a worker thread, cached by key;
- ``state``: one request's matcher and the packed mask of its next token;
- ``manager``: the engine's side: states for new requests, each step's masks, sampled tokens.

The masks reach the device as plain data in the step (``contracts.step.GrammarBitmask``) and are
applied there by ``runner.grammar_mask``.
"""

from meshserve.structured.grammar import build_grammar
from meshserve.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "build_grammar"]
