"""Generation defaults: a request that names no sampling field samples as the model's own
generation config says (vLLM's ``--generation-config auto``), unless the engine is told to keep the
neutral defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshserve import LLM, SamplingParams
from meshserve.runner.loader import generation_defaults

# top_k=1 makes sampling greedy whatever the temperature: the defaults are visible in the tokens.
SHIPPED = {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "repetition_penalty": 1.0,
           "max_new_tokens": 7}
PROMPTS = [[300, 301, 302, 303], [1000, 2000, 3000], [45, 46, 47, 48, 49, 50]]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("defaults") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, folder)
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())  # keep the eos and bos ids save_pretrained wrote
    config_file.write_text(json.dumps({**config, **SHIPPED}))
    return str(folder)


def test_defaults_are_read_under_sampling_params_names(model_with_defaults: str,
                                                       tiny_llama_dir: str) -> None:
    assert generation_defaults(model_with_defaults) == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 1, "repetition_penalty": 1.0, "max_tokens": 7}
    shipped_none = json.loads((Path(tiny_llama_dir) / "generation_config.json").read_text())
    assert not set(shipped_none) & {"temperature", "top_p", "top_k"}
    assert generation_defaults(tiny_llama_dir) == {}


def test_gguf_sampling_metadata_is_read(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.25)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 40)
    writer.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.125)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert generation_defaults(str(path)) == {"temperature": 0.25, "top_k": 40,
                                              "repetition_penalty": 1.125}


@pytest.mark.parametrize("setting", ["auto", "vllm"])
def test_a_request_without_sampling_fields_gets_the_models_defaults(
        model_with_defaults: str, setting: str, capfd: pytest.CaptureFixture) -> None:
    llm = LLM(model_with_defaults, dtype="float32", device="cpu", num_kv_blocks=128,
              generation_config=setting)
    startup = capfd.readouterr().err
    greedy = [o.outputs[0].token_ids
              for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))]
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS)]
    if setting == "auto":
        assert "generation defaults: temperature=0.7, top_p=0.9, top_k=1" in startup
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.7, top_p=0.9, top_k=1, repetition_penalty=1.0, max_tokens=7)
        assert outputs == [g[:7] for g in greedy]  # max_new_tokens, and top_k=1 is greedy
    else:
        assert "generation defaults: neutral (generation_config=vllm)" in startup
        assert llm.get_default_sampling_params() == SamplingParams()
        assert [len(o) for o in outputs] == [16] * len(PROMPTS)
        # Temperature 1 over a random model's near-uniform distribution: far from greedy.
        assert outputs != greedy
