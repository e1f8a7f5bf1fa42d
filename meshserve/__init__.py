"""meshserve: serve open LLMs on TPU pod slices with Ray.

The offline API mirrors vLLM's::

    from meshserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)

Structured output as in vLLM::

    from meshserve import StructuredOutputsParams
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshserve.contracts.sampling import SamplingParams
from meshserve.contracts.structured import StructuredOutputParams

# vLLM spells it with an "s"; code written for vLLM imports that name.
StructuredOutputsParams = StructuredOutputParams

if TYPE_CHECKING:
    from meshserve.engine.llm import LLM, CompletionOutput, Logprob, RequestOutput

# Resolved on first use, so that importing any meshserve module (the device-free scheduler, the
# contracts, the CLI) does not load torch and the engine behind LLM.
_LAZY = {name: "meshserve.engine.llm"
         for name in ("LLM", "RequestOutput", "CompletionOutput", "Logprob")}

__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshserve' has no attribute {name!r}")
