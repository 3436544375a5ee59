"""The automatic attention implementation (``model.attn_implementation: null``): flash-attn when installed on CUDA,
flex_attention on CUDA for packed rows, sdpa otherwise; what is asked for is kept."""

from __future__ import annotations

import importlib.util

import pytest

from verl.utils import model_loading
from verl.utils.model_loading import resolve_attn_implementation


@pytest.fixture(params=[False, True], ids=["no-flash-attn", "flash-attn"])
def flash_installed(request, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flash_attn":
            return object() if request.param else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_loading.importlib.util, "find_spec", find_spec)
    return request.param


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_automatic_choice(flash_installed, device, remove_padding):
    expected = {
        ("cuda", True, False): "flash_attention_2",
        ("cuda", True, True): "flash_attention_2",
        ("cuda", False, False): "sdpa",
        ("cuda", False, True): "flex_attention",  # sdpa's dense [T, T] mask on packed rows is ~3x slower
        ("cpu", True, False): "sdpa",
        ("cpu", True, True): "sdpa",
        ("cpu", False, False): "sdpa",
        ("cpu", False, True): "sdpa",
    }[(device, flash_installed, remove_padding)]
    for requested in (None, "", "auto"):
        assert resolve_attn_implementation(requested, device, remove_padding) == expected


@pytest.mark.parametrize("requested", ["sdpa", "eager", "flex_attention"])
def test_explicit_choice_is_kept(flash_installed, requested):
    assert resolve_attn_implementation(requested, "cuda", remove_padding=True) == requested


def test_flash_attention_without_the_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match="flash_attn package"):
        resolve_attn_implementation("flash_attention_2", "cuda")


def test_loader_builds_packed_models_with_the_automatic_choice(tiny_model_path, monkeypatch):
    """load_causal_lm hands remove_padding to the choice (CPU here: sdpa either way; the choice is patched to see it)."""
    seen = []
    real = model_loading.resolve_attn_implementation

    def spy(requested=None, device=None, remove_padding=False):
        seen.append(remove_padding)
        return real(requested, device, remove_padding)

    monkeypatch.setattr(model_loading, "resolve_attn_implementation", spy)
    model = model_loading.load_causal_lm(str(tiny_model_path), remove_padding=True)
    assert seen == [True] and model.config._attn_implementation == "sdpa"
