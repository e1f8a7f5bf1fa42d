"""Tiny random Llama-family checkpoints for tests, written with transformers' own classes.

Each builder saves a Hugging Face folder (config.json, safetensors, tokenizer) and returns its path.
The models are random but deterministic (``torch.manual_seed(seed)``) and small enough to run in
milliseconds, with the real 49,152-token SmolLM2 tokenizer so that text round-trips.
"""

from __future__ import annotations

import functools
import os

import torch
import transformers

from meshserve.runner.loader import default_model_path

# Shared by every builder: 4 query heads over 2 KV heads (grouped-query attention), head_dim 16.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The bundled GGUF's tokenizer; converting it from GGUF takes seconds, so it is loaded once."""
    folder, file = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)


def build_tiny_llama(tmp_dir: str, *, tie: bool = False, rope_scaling: dict | None = None,
                     seed: int = 0) -> str:
    """A 2-layer Llama; ``rope_scaling`` (e.g. a Llama 3 dict) goes to the config as given."""
    extra = {} if rope_scaling is None else {"rope_scaling": dict(rope_scaling)}
    config = transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=tie, **extra,
                                      **_COMMON, **_token_ids())
    return _save(transformers.LlamaForCausalLM, config, os.path.join(tmp_dir, "tiny-llama"), seed)


def build_tiny_qwen2(tmp_dir: str, seed: int = 0) -> str:
    """A 2-layer Qwen2 (q/k/v projections with biases)."""
    config = transformers.Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False,
                                      **_COMMON, **_token_ids())
    return _save(transformers.Qwen2ForCausalLM, config, os.path.join(tmp_dir, "tiny-qwen2"), seed)


def build_tiny_mistral(tmp_dir: str, seed: int = 0, *, sliding_window: int | None = 128) -> str:
    """A 3-layer Mistral, saved in several safetensors shards (with an index file)."""
    config = transformers.MistralConfig(num_hidden_layers=3, tie_word_embeddings=False,
                                        sliding_window=sliding_window, **_COMMON, **_token_ids())
    # The embedding and lm_head are 12 MiB each in float32, so a 4 MB limit gives each its own file
    # and leaves the layers in a third (transformers never splits a tensor across shards).
    return _save(transformers.MistralForCausalLM, config, os.path.join(tmp_dir, "tiny-mistral"),
                 seed, max_shard_size="4MB")


def _token_ids() -> dict:
    tokenizer = smollm2_tokenizer()
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _save(model_class: type, config: transformers.PretrainedConfig, folder: str, seed: int,
          max_shard_size: str = "1GB") -> str:
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    smollm2_tokenizer().save_pretrained(folder)
    return folder
