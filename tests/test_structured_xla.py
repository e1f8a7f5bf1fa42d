"""On xla, structured output compiles at warm-up: a workload mixing constrained and free requests
after warm-up compiles and traces nothing new, and the constrained outputs still obey their masks.

The engine runs in a child process (torch_xla's runtime, PJRT CPU), on a tiny random Llama.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CODE = r"[a-z]{1,6}-[0-9]{2}"
COLOURS = ["red", "green", "blue"]
RECORD = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def _constraint(index: int):
    from meshserve.contracts.structured import StructuredOutputParams

    kind = ("regex", "choice", "json")[index % 3]
    value = {"regex": CODE, "choice": COLOURS, "json": RECORD}[kind]
    return kind, StructuredOutputParams(**{kind: value, "disable_any_whitespace": kind == "json"})


def _child() -> dict:
    import torch_xla.debug.metrics as met
    from torch._dynamo.utils import counters

    from meshserve import LLM, SamplingParams

    def traced() -> dict[str, int]:
        out = {f"dynamo {name}": count for name, count in counters["stats"].items()}
        out.update({name: met.counter_value(name) or 0
                    for name in ("CachedCompile", "UncachedCompile")})
        return out

    job = json.loads(sys.stdin.read())
    llm = LLM(job["model"], device="xla", dtype="float32", max_num_batched_tokens=64,
              max_num_seqs=16, max_model_len=256, num_kv_blocks=160)
    engine, rng = llm.engine, np.random.default_rng(3)
    graphs, traced_before = engine.backend.num_compiled_graphs(), traced()
    kinds, outputs = {}, {}
    for i in range(18):  # arrivals while others run: constrained and free rows in every bucket
        prompt = rng.integers(100, 40000, size=int(rng.integers(1, 90))).tolist()
        if i % 2:
            kinds[f"c{i}"], constraint = _constraint(i)
            params = SamplingParams(temperature=1.0, max_tokens=48, structured_outputs=constraint)
        else:
            params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=12,
                                    top_k=int(rng.choice([0, 5])), ignore_eos=True,
                                    logprobs=[None, 2][i % 4 // 2])
        request_id = f"c{i}" if i % 2 else f"f{i}"
        outputs[request_id] = []
        engine.add_request(request_id, prompt, params)
        for _ in range(int(rng.integers(0, 3))):
            for delta in engine.step():
                outputs[delta.request_id].extend(delta.token_ids)
    while engine.has_unfinished:
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
    texts = {r: llm.tokenizer.decode(t, skip_special_tokens=True) for r, t in outputs.items()
             if r in kinds}
    return {"graphs_before": graphs, "graphs_after": engine.backend.num_compiled_graphs(),
            "traced_before": traced_before, "traced_after": traced(), "kinds": kinds,
            "texts": texts}


def test_mixed_constrained_workload_after_warm_up_compiles_nothing(tiny_llama_dir: str) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "tests.test_structured_xla"],
                          input=json.dumps({"model": tiny_llama_dir}), capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["graphs_after"] == result["graphs_before"]
    assert result["traced_after"] == result["traced_before"]
    assert len(result["texts"]) == 9
    for request_id, text in result["texts"].items():
        kind = result["kinds"][request_id]
        if kind == "regex":
            assert re.fullmatch(CODE, text), text
        elif kind == "choice":
            assert text in COLOURS, text
        else:
            import jsonschema

            jsonschema.validate(json.loads(text), RECORD)


if __name__ == "__main__":
    print(json.dumps(_child()))
