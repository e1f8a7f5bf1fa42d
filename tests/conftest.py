"""Shared fixtures: tiny random models built on disk, the bundled model, transformers references."""

from __future__ import annotations

import os

# Ray must bind to loopback only; torch_xla must not look for a TPU. Set before any import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_models.build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_models.build_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_models.build_tiny_mistral(str(tmp_path_factory.mktemp("tiny-mistral")))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from meshserve.runner.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str):
    """transformers' own load of the bundled GGUF, dequantized to fp32: the reference."""
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int,
              eos_token_ids: tuple[int, ...]) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` one prompt at a time (no padding effects)."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                                 pad_token_id=eos_token_ids[0], temperature=None, top_p=None,
                                 top_k=None)
        results.append(out[0, len(prompt):].tolist())
    return results


_server_failures: dict[str, BaseException] = {}


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """``meshserve serve`` on the tiny Llama, shared by the HTTP test modules."""
    from tests.server import start_server

    # pytest retries a failed session fixture for every test that uses it; fail fast instead.
    if "tiny" in _server_failures:
        raise _server_failures["tiny"]
    log = tmp_path_factory.mktemp("logs") / "serve-tiny.log"
    try:
        server = start_server(["--model", tiny_llama_dir, "--num-kv-blocks", "400",
                               "--max-model-len", "512", "--max-queued-requests", "256"], log)
    except RuntimeError as exc:
        _server_failures["tiny"] = exc
        raise
    yield server
    server.stop()
