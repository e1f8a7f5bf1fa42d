"""The text edge of a request: incremental detokenization, stop strings, a sequence's text.

Engines, host actors and the router speak token ids only; ``LLM`` and the HTTP ingress turn them
into text here.
"""

from meshserve.text.detokenizer import IncrementalDetokenizer
from meshserve.text.sequence import SequenceText

__all__ = ["IncrementalDetokenizer", "SequenceText"]
