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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` without a CUDA GPU and tests marked ``vllm`` without vLLM."""
    has_gpu = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None  # never import vllm here: it is slow
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("vllm") is not None and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed (import vllm not found)"))
