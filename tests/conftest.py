"""Shared pytest fixtures and hooks for the whole test suite (keep this file small and generic)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Qwen2 model + local tokenizer, built once per test session."""
    from verl.utils.tiny_model import tiny_model_cached

    return tiny_model_cached(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def varied_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its projection weights x8, saved as a folder: a random-init tiny model with tied
    embeddings just repeats the last prompt token; scaling makes greedy continuations vary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(8.0)
    out = tmp_path_factory.mktemp("varied_tiny")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` without a CUDA GPU and tests marked ``vllm`` without vLLM."""
    has_gpu = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None  # never import vllm here: it is slow
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("vllm") is not None and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed (import vllm not found)"))
