"""The automatic attention implementation (``model.attn_implementation: null``): flash-attn when installed on CUDA;
on CUDA for packed rows torch_varlen when torch has ``torch.nn.attention.varlen``, the GPU is Ampere or newer and the
model has no sliding-window layers or attention dropout, else flex_attention; sdpa otherwise; never flex_attention
under ``compile_layers`` (refused instead); what is asked for is kept. The loaders (actor/ref, critic, the benchmarks'
builder) hand the model's config and compile_layers to the choice."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlavaConfig, MistralConfig, Qwen2Config

from verl.utils import model_loading
from verl.utils.model_loading import resolve_attn_implementation
from verl.workers.actor import varlen_attention

REAL_GPU_SUPPORTED = varlen_attention.gpu_supported  # the autouse fixture below replaces it


@pytest.fixture(params=[False, True], ids=["no-flash-attn", "flash-attn"])
def flash_installed(request, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flash_attn":
            return object() if request.param else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_loading.importlib.util, "find_spec", find_spec)
    return request.param


@pytest.fixture(autouse=True)
def ampere_gpu(monkeypatch):
    """The (faked) CUDA device can run FA2 kernels; ``test_pre_ampere_gpus_fall_back_to_flex`` says otherwise."""
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)


@pytest.fixture(params=[False, True], ids=["torch-no-varlen", "torch-varlen"])
def varlen(request, monkeypatch):
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: request.param)
    return request.param


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name, *a, **k: None)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_automatic_choice(flash_installed, varlen, device, remove_padding):
    packed_on_cuda = "torch_varlen" if varlen else "flex_attention"  # one H200: varlen 5-8% faster than flex
    expected = {
        ("cuda", True, False): "flash_attention_2",
        ("cuda", True, True): "flash_attention_2",
        ("cuda", False, False): "sdpa",
        ("cuda", False, True): packed_on_cuda,  # sdpa's dense [T, T] mask on packed rows is ~3x slower
        ("cpu", True, False): "sdpa",
        ("cpu", True, True): "sdpa",
        ("cpu", False, False): "sdpa",
        ("cpu", False, True): "sdpa",
    }[(device, flash_installed, remove_padding)]
    for requested in (None, "", "auto"):
        assert resolve_attn_implementation(requested, device, remove_padding) == expected


def test_automatic_torch_varlen_is_registered(no_flash, monkeypatch):
    from transformers import AttentionInterface

    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    monkeypatch.delitem(AttentionInterface._global_mapping, "torch_varlen", raising=False)
    varlen_attention.register.cache_clear()
    assert resolve_attn_implementation(None, "cuda", remove_padding=True) == "torch_varlen"
    assert AttentionInterface._global_mapping["torch_varlen"] is varlen_attention.torch_varlen_attention


SLIDING = {
    "mistral": MistralConfig(sliding_window=4096),  # every layer, no layer_types
    "qwen2-sliding": Qwen2Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2),
    "dropout": Qwen2Config(attention_dropout=0.1),
}


def test_model_unsupported_by_varlen_names_what():
    assert varlen_attention.model_unsupported(None) == ""
    assert varlen_attention.model_unsupported(Qwen2Config()) == ""  # use_sliding_window=False: sliding_window None
    assert varlen_attention.model_unsupported(SLIDING["mistral"]) == "sliding-window layers (sliding_window=4096)"
    assert "sliding-window layers" in varlen_attention.model_unsupported(SLIDING["qwen2-sliding"])
    assert varlen_attention.model_unsupported(SLIDING["dropout"]) == "attention dropout (attention_dropout=0.1)"
    # only the layer types say so (a config class that keeps no window size)
    layer_types = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=None)
    assert varlen_attention.model_unsupported(layer_types) == "sliding-window layers (sliding_window=None)"


def test_unsupported_gathers_the_rules_in_order(monkeypatch):
    """torch first, then the model, then the GPU (asked only when nothing else rules varlen out, for the device
    given): the first reason found is the one reported."""
    asked = []

    def gpu_supported(device=None):
        asked.append(device)
        return False

    monkeypatch.setattr(varlen_attention, "gpu_supported", gpu_supported)
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: False)
    no_varlen = f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    assert varlen_attention.unsupported(SLIDING["dropout"], "cuda:0") == no_varlen
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    assert varlen_attention.unsupported(SLIDING["dropout"], "cuda:0") == "attention dropout (attention_dropout=0.1)"
    assert asked == []
    old_gpu = "the GPU is older than Ampere (compute capability < 8.0: no FA2 kernels)"
    assert varlen_attention.unsupported(Qwen2Config(), "cuda:1") == old_gpu and asked == ["cuda:1"]
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)
    assert varlen_attention.unsupported(Qwen2Config(), "cuda:1") == "" == varlen_attention.unsupported()


@pytest.mark.parametrize("name", list(SLIDING))
def test_models_varlen_cannot_run_fall_back_to_flex(no_flash, monkeypatch, name):
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    config = SLIDING[name]
    assert resolve_attn_implementation(None, "cuda", True, model_config=config) == "flex_attention"
    assert resolve_attn_implementation(None, "cuda", True, model_config=Qwen2Config()) == "torch_varlen"
    with pytest.raises(
        ValueError, match=r"attn_implementation='torch_varlen' does not run this model's (sliding|atte)"
    ):
        resolve_attn_implementation("torch_varlen", "cuda", True, model_config=config)


def test_pre_ampere_gpus_fall_back_to_flex(no_flash, monkeypatch):
    seen = []

    def gpu_supported(device=None):
        seen.append(device)
        return False

    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "gpu_supported", gpu_supported)
    assert resolve_attn_implementation(None, "cuda:1", remove_padding=True) == "flex_attention"
    assert seen == ["cuda:1"]  # the device the model is loaded for
    with pytest.raises(ValueError, match=r"not torch_varlen: the GPU is older than Ampere \(compute capability < 8"):
        resolve_attn_implementation(None, "cuda", True, compile_layers=True)
    assert resolve_attn_implementation("torch_varlen", "cuda", True) == "torch_varlen"  # asked for: kept


def test_compile_layers_never_gets_flex_automatically(no_flash, monkeypatch):
    """With varlen: torch_varlen as without compile_layers. Without it (or for a sliding-window model) the automatic
    choice would be flex_attention, which compiled layers do not take: a ValueError naming the keys and why."""
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    assert resolve_attn_implementation(None, "cuda", True, compile_layers=True) == "torch_varlen"
    assert resolve_attn_implementation(None, "cuda", False, compile_layers=True) == "sdpa"  # padded
    assert resolve_attn_implementation(None, "cpu", True, compile_layers=True) == "sdpa"
    with pytest.raises(ValueError, match=r"is null: .* flex_attention here, not torch_varlen: sliding-window layers"):
        resolve_attn_implementation(None, "cuda", True, model_config=SLIDING["mistral"], compile_layers=True)
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: False)
    with pytest.raises(ValueError) as err:
        resolve_attn_implementation(None, "cuda", True, compile_layers=True)
    message = str(err.value)
    assert (
        "actor_rollout_ref.model.compile_layers=True with actor_rollout_ref.model.attn_implementation=flex" in message
    )
    assert (
        "on CUDA inductor fails" in message
        and "attn_implementation=torch_varlen (CUDA, torch >= 2.10) or sdpa" in message
    )
    assert "actor_rollout_ref.model.attn_implementation is null" in message and "torch.nn.attention.varlen" in message
    assert resolve_attn_implementation(None, "cuda", True) == "flex_attention"  # without compile_layers: flex


@pytest.mark.parametrize("requested", ["sdpa", "eager", "flex_attention"])
def test_explicit_choice_is_kept(flash_installed, requested):
    assert resolve_attn_implementation(requested, "cuda", remove_padding=True) == requested


def test_flash_attention_without_the_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match="flash_attn package"):
        resolve_attn_implementation("flash_attention_2", "cuda")


def test_loader_builds_packed_models_with_the_automatic_choice(tiny_model_path, monkeypatch):
    """load_causal_lm hands remove_padding, the model's config and compile_layers to the choice (CPU here: sdpa
    either way; the choice is patched to see it)."""
    seen = []
    real = model_loading.resolve_attn_implementation

    def spy(requested=None, device=None, remove_padding=False, **kwargs):
        seen.append((remove_padding, type(kwargs["model_config"]).__name__, kwargs["compile_layers"]))
        return real(requested, device, remove_padding, **kwargs)

    monkeypatch.setattr(model_loading, "resolve_attn_implementation", spy)
    model = model_loading.load_causal_lm(str(tiny_model_path), remove_padding=True)
    assert seen == [(True, "Qwen2Config", False)] and model.config._attn_implementation == "sdpa"
    # the config the choice sees is the one built, overrides applied (a window or dropout there rules varlen out)
    configs = []
    monkeypatch.setattr(
        model_loading, "resolve_attn_implementation", lambda *a, **kw: configs.append(kw["model_config"]) or "sdpa"
    )
    model_loading.load_causal_lm(str(tiny_model_path), override_config={"attention_dropout": 0.25})
    assert len(configs) == 1 and (type(configs[0]).__name__, configs[0].attention_dropout) == ("Qwen2Config", 0.25)


def test_critic_loader_hands_the_model_config_to_the_choice(tiny_model_path, monkeypatch):
    from verl.workers.critic.critic_worker import load_value_model

    seen = []
    real = model_loading.resolve_attn_implementation

    def spy(requested=None, device=None, remove_padding=False, **kwargs):
        seen.append((remove_padding, type(kwargs["model_config"]).__name__))
        return real(requested, device, remove_padding, **kwargs)

    monkeypatch.setattr(model_loading, "resolve_attn_implementation", spy)
    load_value_model(str(tiny_model_path), remove_padding=True)
    assert seen == [(True, "Qwen2Config")]
    # the value model's config (num_labels=1), overrides applied before the choice
    configs = []
    monkeypatch.setattr(
        model_loading, "resolve_attn_implementation", lambda *a, **kw: configs.append(kw["model_config"]) or "sdpa"
    )
    load_value_model(str(tiny_model_path), override_config={"attention_dropout": 0.25})
    assert len(configs) == 1 and (configs[0].num_labels, configs[0].attention_dropout) == (1, 0.25)


def test_benchmark_builder_hands_config_and_compile_layers_to_the_choice(no_flash, monkeypatch):
    """``build_causal_lm_from_config`` (the benchmarks' builder), CUDA faked for the choice, weights on CPU: a
    sliding-window model gets flex_attention; compile_layers without varlen is refused before anything is built."""
    monkeypatch.setattr(model_loading.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    sliding = MistralConfig(sliding_window=16, num_hidden_layers=1, **small)
    model = model_loading.build_causal_lm_from_config(sliding, remove_padding=True)
    assert model.config._attn_implementation == "flex_attention"
    plain = Qwen2Config(num_hidden_layers=1, **small)
    assert model_loading.build_causal_lm_from_config(plain, remove_padding=True).config._attn_implementation == (
        "torch_varlen"
    )
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: False)
    with pytest.raises(ValueError, match="attn_implementation is null: the automatic choice"):
        model_loading.build_causal_lm_from_config(plain, remove_padding=True, compile_layers=True)


def test_gpu_supported_is_compute_capability_8_or_newer(monkeypatch):
    seen = []

    for capability, expected in (((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True), ((12, 0), True)):
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda device=None, c=capability: seen.append(device) or c
        )
        assert REAL_GPU_SUPPORTED("cuda:0") is expected, capability
    assert seen == ["cuda:0"] * 5


def test_cpu_workers_on_a_gpu_host_keep_sdpa_for_packed_rows(tiny_model_path, no_flash, monkeypatch):
    """The choice follows the worker's device, not whether the host has a GPU: a CPU actor/ref/critic (trainer.device
    =cpu on a GPU machine, e.g. the CPU test suite run there) with packed rows loads sdpa, not the CUDA-only
    torch_varlen (CUDA and varlen faked available)."""
    from tests.cpu_workers import build_cpu_workers

    monkeypatch.setattr(model_loading.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)
    # control: without a device the choice is the host's
    assert model_loading.resolve_attn_implementation(None, None, True) == "torch_varlen"
    actor, critic = build_cpu_workers(
        monkeypatch,
        tiny_model_path,
        [
            "actor_rollout_ref.model.use_remove_padding=True",
            "critic.model.use_remove_padding=True",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ],
    )
    modules = {"actor": actor.actor_module, "ref": actor.ref.actor_module, "critic": critic.critic_module}
    assert {name: m.config._attn_implementation for name, m in modules.items()} == dict.fromkeys(modules, "sdpa")


def test_messages_name_the_section_of_the_caller(tiny_model_path, monkeypatch):
    """The attention and liger messages name the config section of the model being loaded: the critic's
    (``critic.model``) and the SFT trainer's (``model``), the actor's by default."""
    from verl.utils.liger import compile_conflict
    from verl.workers.critic.critic_worker import load_value_model

    with pytest.raises(ValueError, match=r"^critic\.model\.attn_implementation='torch_varlen' needs CUDA"):
        load_value_model(tiny_model_path, attn_implementation="torch_varlen", device="cpu")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.model\.attn_implementation='torch_varlen' needs CUDA"):
        model_loading.load_causal_lm(tiny_model_path, attn_implementation="torch_varlen", device="cpu")
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match=r"^model\.attn_implementation='flash_attention_2' needs CUDA"):
        resolve_attn_implementation("flash_attention_2", "cpu", section="model")
    with pytest.raises(ValueError) as refused:
        model_loading.load_causal_lm(tiny_model_path, use_liger=True, compile_layers=True, section="model")
    assert str(refused.value) == compile_conflict("model")
    # automatic flex under compile_layers (a model torch_varlen cannot run: sliding window) names the caller's keys
    config = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match=r"model\.compile_layers.*\(model\.attn_implementation is null"):
        resolve_attn_implementation(None, "cuda", True, model_config=config, compile_layers=True, section="model")


@pytest.mark.parametrize("flash_installed", [False, True])
def test_shared_prompts_get_flex_for_packed_rows_on_cuda(monkeypatch, flash_installed):
    """``model.share_prompts`` (verl/workers/actor/shared_prompts.py) needs a mask: packed rows on CUDA without
    flash-attn get flex_attention rather than torch_varlen; flash-attn, where installed, stays first; padded rows,
    CPU, compiled layers, sliding-window models and models with a hidden size under 1024 (SmolLM2-135M: measured
    faster unshared on torch_varlen) keep the old order."""
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if flash_installed else None) if name == "flash_attn" else real_find_spec(name, *a),
    )
    packed_shared = "flash_attention_2" if flash_installed else "flex_attention"
    unshared = "flash_attention_2" if flash_installed else "torch_varlen"
    assert resolve_attn_implementation(None, "cuda", True, share_prompts=True) == packed_shared
    assert resolve_attn_implementation(None, "cuda", True, share_prompts=False) == unshared
    qwen2 = resolve_attn_implementation(None, "cuda", True, model_config=Qwen2Config(), share_prompts=True)
    assert qwen2 == packed_shared
    assert resolve_attn_implementation(None, "cuda", False, share_prompts=True) == (
        "flash_attention_2" if flash_installed else "sdpa"
    )
    assert resolve_attn_implementation(None, "cpu", True, share_prompts=True) == "sdpa"
    assert resolve_attn_implementation(None, "cuda", True, compile_layers=True, share_prompts=True) == unshared
    sliding = resolve_attn_implementation(None, "cuda", True, model_config=SLIDING["mistral"], share_prompts=True)
    assert sliding == ("flash_attention_2" if flash_installed else "flex_attention")
    assert resolve_attn_implementation("sdpa", "cuda", True, share_prompts=True) == "sdpa"  # asked for: kept
    # small models run faster unshared on torch_varlen (model_loading.SHARED_PROMPTS_MIN_HIDDEN_SIZE, measured)
    smollm2_135m = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    assert resolve_attn_implementation(None, "cuda", True, model_config=smollm2_135m, share_prompts=True) == unshared
    for hidden_size, shared in ((1023, False), (1024, True), (1536, True)):
        config = Qwen2Config(hidden_size=hidden_size, num_attention_heads=8, num_key_value_heads=2)
        got = resolve_attn_implementation(None, "cuda", True, model_config=config, share_prompts=True)
        assert got == (packed_shared if shared else unshared), hidden_size
        assert model_loading.shares_prompts_on_flex(config) is shared
    assert model_loading.shares_prompts_on_flex(None) and not model_loading.shares_prompts_on_flex(SLIDING["mistral"])
    # a composite (vision-language) config: its text model's hidden size counts
    text = dict(model_type="llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024)
    assert not model_loading.shares_prompts_on_flex(LlavaConfig(text_config={**text, "hidden_size": 576}))
    assert model_loading.shares_prompts_on_flex(LlavaConfig(text_config={**text, "hidden_size": 2048}))
