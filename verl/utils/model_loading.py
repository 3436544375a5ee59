"""Load a Hugging Face causal LM for training (actor / reference / critic backbones).

Any ``AutoModelForCausalLM`` checkpoint loads by path (Qwen2/Qwen2.5, Llama, SmolLM, ...), exactly as a user
passes ``actor_rollout_ref.model.path``. Options:

* ``dtype``: parameter dtype (``"float32"`` for a trained actor whose FSDP mixed precision computes in bf16;
  ``"bfloat16"`` for a frozen reference model);
* ``attn_implementation``: ``None`` picks, in order: ``flash_attention_2`` when CUDA is available and the
  ``flash_attn`` package is installed; on CUDA with packed rows (``remove_padding``, the config's
  ``use_remove_padding``) ``torch_varlen`` when torch has ``torch.nn.attention.varlen`` (torch >= 2.10), the GPU
  is Ampere or newer and the model has nothing it cannot run (sliding-window layers, attention dropout:
  ``varlen_attention.model_unsupported``), else ``flex_attention``; otherwise (padded rows, CPU) ``sdpa``. With
  ``share_prompts`` (the config's ``model.share_prompts``, on by default) packed rows on CUDA without flash-attn get
  ``flex_attention`` before ``torch_varlen`` for models with a hidden size of 1024 or more: rows sharing a prompt
  need a mask, which variable-length kernels cannot take (``verl/workers/actor/shared_prompts.py``; measured at
  ``SHARED_PROMPTS_MIN_HIDDEN_SIZE``: smaller models run faster unshared on ``torch_varlen``).
  All of them run packed (remove-padding) sequences exactly: transformers derives variable-length boundaries (FA2)
  or a dense block-diagonal mask (``sdpa``/``eager``) from ``position_ids`` that restart at 0 when no
  ``attention_mask`` is passed; for ``flex_attention`` the actor and critic pass the block-diagonal ``BlockMask``
  themselves (``verl/workers/actor/packed_block_mask.py``: built without transformers' compiled
  ``create_block_mask``), for ``torch_varlen`` the sequence offsets (``cu_seq_lens``). fp32 on H200: packed vs
  padded log-probs within 6e-6 for sdpa and flex.
  Why this order on a GPU without flash-attn (one H200, 2026-12-03, torch 2.11, Qwen2.5-1.5B, the MemAgent layout of
  ``benchmarks/bench_update_policy.py --layout memagent --conversations 32 --chunks 3 --chunk 5000 --memory 1024
  --final-len 1024 --mini-batches 4 --token-budget 16384 --steps 1 --no-baseline --grad-ckpt``, 659,686 tokens per
  call): ``torch_varlen`` compute_log_prob 112.9k tokens/s (44.1% MFU) and update_policy 26.5k (31.0% MFU) vs
  ``flex_attention`` 104.8k (41.0%) and 25.1k (29.5%), the same peak memory (28.8 GiB) and grad norm (3.1939 vs
  3.1933), and no flex compile at start-up (the whole process 89 s vs 125 s). Earlier (2x H200): flex on packed
  rows 32.9k tokens/s/GPU vs sdpa 22.7k padded and 11.0k packed (sdpa's dense mask costs O(T^2)). On CPU use
  ``sdpa`` (flex needs a compiler backend; varlen is CUDA only). ``torch_varlen`` asked for explicitly needs CUDA,
  torch >= 2.10 and a model it can run (``ValueError`` otherwise); ``verl/workers/actor/varlen_attention.py``
  registers it with transformers; float32 inputs are computed in bf16 (FA2 kernels). With ``compile_layers`` the
  automatic choice never is ``flex_attention`` (``verl/utils/compile_layers.py``): where it would be, loading
  raises a ``ValueError`` that says so;
* ``gradient_checkpointing`` (non-reentrant); ``gradient_checkpointing_every`` N > 1 keeps it only on the decoder
  layers whose index is a multiple of N (torchtitan's selective activation checkpointing by layer: the other
  layers keep their activations and skip the recomputed forward; ``select_checkpointed_layers``);
* ``lora``: a dict of ``peft.LoraConfig`` arguments (``r``, ``lora_alpha``, ``target_modules``, ...);
  ``r <= 0`` or ``None`` disables LoRA;
* ``use_liger``: liger-kernel's fused RMSNorm/SwiGLU/RoPE kernels (``verl/utils/liger.py``): ``None`` resolves for
  ``device`` (on with CUDA, the package, no ``compile_layers`` and a model type liger patches); ``True`` applies them
  on CUDA when the package imports (otherwise a warning and nothing changes); ``True`` with ``compile_layers`` raises
  ``ValueError`` (dynamo cannot trace liger's RMSNorm);
* ``compile_layers``: ``torch.compile`` each decoder layer in place (``verl/utils/compile_layers.py``), after
  the three above, before the worker shards the model with FSDP2.

Nothing here downloads anything: paths must be local folders (or already in the local HF cache).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from verl.utils.liger import apply_liger_kernel, compile_conflict, resolve_use_liger

__all__ = [
    "resolve_dtype",
    "resolve_attn_implementation",
    "shares_prompts_on_flex",
    "load_causal_lm",
    "load_tokenizer",
    "build_causal_lm_from_config",
    "prepare_for_training",
    "select_checkpointed_layers",
    "apply_lora",
    "apply_liger_kernel",
    "load_model_config",
    "count_parameters",
]

logger = logging.getLogger(__name__)
CKPT_EVERY_KEY = "actor_rollout_ref.model.gradient_checkpointing_every"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (and so on); ``None`` -> float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; valid: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


# The smallest hidden size for which the automatic attention choice shares prompts on flex_attention rather than
# packing them unshared for torch_varlen. Measured (benchmarks/RESULTS.md): Qwen2.5-1.5B, one H200, MemAgent's layout
# of 3 chunks of 5,000 tokens (20% of the tokens shared): the update alone 15.8 s shared on flex vs 17.4 s on
# torch_varlen, the ref pass 4.66 s vs 5.32 s; one H100, 6 chunks (9.4% shared): log-prob pass 4.56 vs 4.98 s, update
# 16.46 vs 16.69 s. SmolLM2-135M (hidden 576, 8 chunks of 512, groups of 8, 8% shared), one H100: the one-step-off
# step 105.0K tokens/s on torch_varlen vs 90.1K shared on flex, the update 3.40-3.44 s vs 4.08-4.12 s; Qwen2.5-0.5B
# (hidden 896) at that layout: the update 7.29 s vs 8.84 s. (The log-prob figures at the 135M layout in the
# eighteenth and nineteenth runs included flex's dynamic-shape compile; without it flex's pass is 1.29x
# torch_varlen's there: twentieth run.) The hidden size fits the recipes' model/layout pairs.
SHARED_PROMPTS_MIN_HIDDEN_SIZE = 1024


def shares_prompts_on_flex(model_config: Any) -> bool:
    """Whether ``share_prompts`` makes the automatic choice ``flex_attention`` for this model (``model_config``:
    its transformers config, ``None``: assumed large enough): models whose text model (the config itself, or its
    ``get_text_config()``) has full attention only (no sliding window) and a hidden size of at least
    ``SHARED_PROMPTS_MIN_HIDDEN_SIZE``; for smaller ones flex_attention costs more than the shared prompt tokens
    save."""
    from verl.workers.actor.packed_block_mask import config_has_full_attention_only

    if model_config is None:
        return True
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden_size = getattr(text_config, "hidden_size", None)
    large = hidden_size is None or hidden_size >= SHARED_PROMPTS_MIN_HIDDEN_SIZE
    return large and config_has_full_attention_only(text_config)


def resolve_attn_implementation(
    requested: Optional[str] = None,
    device: Union[str, torch.device, None] = None,
    remove_padding: bool = False,
    *,
    model_config: Any = None,
    compile_layers: bool = False,
    section: str = "actor_rollout_ref.model",
    share_prompts: bool = False,
) -> str:
    """Attention backend: ``requested`` if given, else (module docstring) ``flash_attention_2`` on CUDA with
    flash-attn installed, else for packed rows (``remove_padding``) on CUDA ``torch_varlen`` (torch >= 2.10, an
    Ampere or newer GPU and a ``model_config`` it can run) or ``flex_attention``, else ``sdpa``.

    ``device`` defaults to CUDA when available. ``model_config``: the transformers config to be built (``None``:
    assumed runnable by ``torch_varlen``). ``compile_layers``: the layers will be compiled; an automatic choice of
    ``flex_attention`` then raises ``ValueError`` (``compile_layers.unsupported``) naming the keys. Asking for
    ``flash_attention_2`` without the package or without CUDA raises ``ValueError``; so does ``torch_varlen``
    without CUDA, without ``torch.nn.attention.varlen`` or for a model it cannot run; choosing it (asked for or
    automatic) registers it with transformers. ``section``: the config section the messages name (``critic.model``
    for the critic, ``model`` in the SFT trainer). ``share_prompts`` (``model.share_prompts``): packed rows on CUDA
    without flash-attn get ``flex_attention`` rather than torch_varlen (which cannot share a prompt), unless the
    layers will be compiled, the model has sliding-window layers or it is small (``shares_prompts_on_flex``).
    """
    from verl.workers.actor import varlen_attention

    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    has_flash = importlib.util.find_spec("flash_attn") is not None
    key = f"{section}.attn_implementation"
    if requested in (None, "", "auto"):
        if on_cuda and has_flash:
            return "flash_attention_2"
        # rows sharing a prompt need a mask, which only flex_attention takes; measured to pay at 1.5B, not at 135M
        # (shares_prompts_on_flex)
        shares = share_prompts and remove_padding and not compile_layers and shares_prompts_on_flex(model_config)
        if on_cuda and shares:
            return "flex_attention"
        if not (on_cuda and remove_padding):
            return "sdpa"  # sdpa's dense [T, T] mask on packed rows is ~3x slower than flex/varlen on H200
        why_not_varlen = varlen_attention.unsupported(model_config, device)
        if not why_not_varlen:
            varlen_attention.register()
            return varlen_attention.NAME
        from verl.utils.compile_layers import unsupported

        reason = unsupported("flex_attention", on_cuda, section) if compile_layers else ""
        if reason:
            raise ValueError(
                f"{reason} ({key} is null: the automatic choice for packed rows on CUDA is flex_attention here, "
                f"not torch_varlen: {why_not_varlen})"
            )
        return "flex_attention"
    if requested == "flash_attention_2" and not (on_cuda and has_flash):
        raise ValueError(
            f"{key}='flash_attention_2' needs CUDA and the flash_attn package "
            f"(cuda={on_cuda}, flash_attn installed={has_flash}); use 'sdpa' or leave it unset"
        )
    if requested == varlen_attention.NAME:
        if not (on_cuda and varlen_attention.varlen_available()):
            raise ValueError(
                f"{key}='torch_varlen' needs CUDA and torch >= 2.10 "
                f"(torch.nn.attention.varlen; cuda={on_cuda}, torch {torch.__version__}, "
                f"varlen available={varlen_attention.varlen_available()}); use 'flex_attention' or leave it unset"
            )
        not_varlen = varlen_attention.model_unsupported(model_config)
        if not_varlen:
            raise ValueError(
                f"{key}='torch_varlen' does not run this model's {not_varlen}; use 'flex_attention' or leave it unset"
            )
        varlen_attention.register()
    return requested


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of (trainable) parameters; tied weights are counted once."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        total += param.numel()
    return total


def apply_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters (``lora``: ``peft.LoraConfig`` arguments).

    Defaults: ``task_type="CAUSAL_LM"``, ``target_modules="all-linear"``, ``lora_alpha = r``, dropout 0.
    Only the adapter weights stay trainable.
    """
    from peft import LoraConfig, get_peft_model

    kwargs = dict(lora)
    rank = int(kwargs.pop("r", kwargs.pop("lora_rank", 0)) or 0)
    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got r={rank}")
    kwargs.setdefault("lora_alpha", rank)
    kwargs.setdefault("target_modules", "all-linear")
    kwargs.setdefault("lora_dropout", 0.0)
    kwargs.setdefault("bias", "none")
    kwargs.setdefault("task_type", "CAUSAL_LM")
    return get_peft_model(model, LoraConfig(r=rank, **kwargs))


def select_checkpointed_layers(model: nn.Module, every: int) -> list[int]:
    """After ``gradient_checkpointing_enable``: keep checkpointing on the decoder layers whose index is a multiple of
    ``every`` and turn it off on the others; returns the checkpointed layers' indices. transformers' decoder layers
    are ``GradientCheckpointingLayer``s that checkpoint their call when ``self.gradient_checkpointing and
    self.training``, so the flag is per layer; it is an attribute of the layer object, which ``nn.Module.compile``
    and FSDP2's ``fully_shard`` keep. The layers are found as ``compile_layers.decoder_layers`` finds them (also
    inside a peft wrapper). Raises ``ValueError`` naming the key for ``every`` that is not an integer >= 1 and, when
    ``every`` > 1, for a model whose decoder layers are not ``GradientCheckpointingLayer``s."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from verl.utils.compile_layers import decoder_layers

    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{CKPT_EVERY_KEY} must be an integer >= 1 (got {every!r})")
    layers = decoder_layers(model)
    if every > 1 and (not layers or not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers)):
        raise ValueError(
            f"{CKPT_EVERY_KEY}={every} needs decoder layers that are transformers GradientCheckpointingLayers "
            f"({type(model).__name__} has {sorted({type(layer).__name__ for layer in layers}) or 'none declared'}); "
            f"set {CKPT_EVERY_KEY}=1"
        )
    checkpointed = []
    for index, layer in enumerate(layers):
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = bool(layer.gradient_checkpointing) and index % every == 0
            if layer.gradient_checkpointing:
                checkpointed.append(index)
    if every > 1:
        logger.info(
            "gradient checkpointing on %d of %d decoder layers: %s", len(checkpointed), len(layers), checkpointed
        )
    return checkpointed


def prepare_for_training(
    model: nn.Module,
    gradient_checkpointing: bool = False,
    lora: Optional[dict[str, Any]] = None,
    use_liger: Optional[bool] = False,
    compile_layers: bool = False,
    gradient_checkpointing_every: int = 1,
    device: Union[str, torch.device, None] = None,
    section: str = "actor_rollout_ref.model",
) -> nn.Module:
    """Apply liger kernels, gradient checkpointing (on every ``gradient_checkpointing_every``-th decoder layer,
    ``select_checkpointed_layers``), LoRA and the per-layer compile (in that order) and return the (maybe wrapped)
    model. ``use_liger`` ``None``: the automatic choice for ``device`` (``None``: the host's) and the model's type
    (``liger.resolve_use_liger``); ``True`` with ``compile_layers`` raises ``ValueError``. ``section``: the config
    section the messages name."""
    if use_liger and compile_layers:
        raise ValueError(compile_conflict(section))
    use_liger = resolve_use_liger(
        use_liger,
        device,
        model_config=getattr(model, "config", None),
        compile_layers=compile_layers,
        key=f"{section}.use_liger",
    )
    if use_liger:
        apply_liger_kernel(model, device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        select_checkpointed_layers(model, gradient_checkpointing_every)
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
    if lora and int(lora.get("r", lora.get("lora_rank", 0)) or 0) > 0:
        if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()  # frozen embeddings + checkpointing need grads on the inputs
        model = apply_lora(model, lora)
    if compile_layers:
        from verl.utils.compile_layers import compile_decoder_layers

        compile_decoder_layers(model)
    return model


def load_tokenizer(model_cfg: Any) -> Any:
    """The policy's tokenizer from the ``actor_rollout_ref.model`` section: ``path`` with ``trust_remote_code``
    (custom tokenizer code shipped with the checkpoint runs only when that key allows it). ``model_cfg``: the typed
    ``ModelConfig``, a DictConfig or a dict."""
    from transformers import AutoTokenizer

    from verl.workers.config.model import ModelConfig

    model = ModelConfig.from_config(model_cfg)
    return AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)


def load_model_config(
    path: Union[str, os.PathLike], trust_remote_code: bool = False, override_config: Optional[dict[str, Any]] = None
) -> Any:
    """The transformers config of the local model folder ``path`` with ``override_config`` applied (what
    ``load_causal_lm`` builds; the workers resolve ``use_liger: null`` on it before loading)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path '{path}' is not a local folder (nothing is downloaded at run time)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    return config


def load_causal_lm(
    path: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype, None] = "float32",
    attn_implementation: Optional[str] = None,
    gradient_checkpointing: bool = False,
    lora: Optional[dict[str, Any]] = None,
    use_liger: Optional[bool] = False,
    compile_layers: bool = False,
    trust_remote_code: bool = False,
    device: Union[str, torch.device, None] = None,
    override_config: Optional[dict[str, Any]] = None,
    remove_padding: bool = False,
    gradient_checkpointing_every: int = 1,
    section: str = "actor_rollout_ref.model",
    share_prompts: bool = False,
) -> nn.Module:
    """Load a causal LM from a local folder ``path`` and prepare it for training.

    Args:
        path: local HF model folder (``config.json`` + weights).
        dtype: parameter dtype (see module docstring).
        attn_implementation: ``None``/``"auto"`` for the automatic choice, or a transformers backend name.
        gradient_checkpointing, lora, use_liger, compile_layers, gradient_checkpointing_every: see
            ``prepare_for_training``.
        trust_remote_code: passed to transformers.
        device: where the weights go (default: stay on CPU, ready for FSDP to move shards).
        override_config: config attributes to override (e.g. ``{"attention_dropout": 0.0}``).
        remove_padding: the model will run packed rows (``use_remove_padding``); picks the automatic attention.
        share_prompts: packed rows will share prompts (``model.share_prompts``); picks the automatic attention.
        section: the config section error messages and logs name (``model`` in the SFT trainer).
    """
    from transformers import AutoModelForCausalLM

    config = load_model_config(path, trust_remote_code, override_config)
    attn = resolve_attn_implementation(
        attn_implementation,
        device,
        remove_padding,
        model_config=config,
        compile_layers=compile_layers,
        section=section,
        share_prompts=share_prompts,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=resolve_dtype(dtype), attn_implementation=attn, trust_remote_code=trust_remote_code
    )
    if device is not None:
        model.to(device)
    return prepare_for_training(
        model, gradient_checkpointing, lora, use_liger, compile_layers, gradient_checkpointing_every, device, section
    )


def build_causal_lm_from_config(
    config: Any,
    dtype: Union[str, torch.dtype, None] = "float32",
    attn_implementation: Optional[str] = None,
    gradient_checkpointing: bool = False,
    device: Union[str, torch.device, None] = None,
    seed: Optional[int] = 0,
    use_liger: Optional[bool] = False,
    compile_layers: bool = False,
    remove_padding: bool = False,
    gradient_checkpointing_every: int = 1,
    share_prompts: bool = False,
) -> nn.Module:
    """Randomly initialise a causal LM from a transformers config object (benchmarks and tests); the options are
    ``load_causal_lm``'s."""
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    config._attn_implementation = resolve_attn_implementation(
        attn_implementation,
        device,
        remove_padding,
        model_config=config,
        compile_layers=compile_layers,
        share_prompts=share_prompts,
    )
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))
    return prepare_for_training(
        model,
        gradient_checkpointing,
        use_liger=use_liger,
        compile_layers=compile_layers,
        gradient_checkpointing_every=gradient_checkpointing_every,
        device=device,
    )
