"""meshserve: serve open LLMs on TPU pod slices with Ray.

The offline API mirrors vLLM's::

    from meshserve import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
"""

from meshserve.engine.llm import LLM, CompletionOutput, Logprob, RequestOutput
from meshserve.engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
