"""The dimensions of a Llama-layout decoder (Qwen2/Qwen3/Llama/Mistral) that decide its memory: parameter counts and
shapes, KV-cache bytes per token, saved activations per token (the formulas and their sources:
``verl/utils/memory_estimate.py``'s docstring, which uses them for the startup memory estimate)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "count_params_on_meta"]

# Model types whose parameters follow the Llama layout (q/k/v/o, gate/up/down, two RMSNorms per layer).
_LLAMA_LIKE = {"qwen2": (True, False), "qwen3": (None, None), "llama": (None, None), "mistral": (False, False)}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-layout decoder (Qwen2/Qwen3/Llama/Mistral) that decide its memory."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # parameters the formula misses (architectures outside the Llama layout: counted exactly on the meta device)
    extra_params: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a transformers config; other model types than ``_LLAMA_LIKE`` are counted on the meta device."""
        mt = str(getattr(config, "model_type", ""))
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = _LLAMA_LIKE.get(mt, (attention_bias, attention_bias))
        shape = cls(
            vocab_size=int(config.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(
                getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
            ),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=mt == "qwen3",
        )
        if mt not in _LLAMA_LIKE:
            shape = cls(**{**shape.__dict__, "extra_params": count_params_on_meta(config) - shape.num_params})
        return shape

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: the seven linears (+ biases), two RMSNorms (+ q/k norms in Qwen3)."""
        lin = self.linear_shapes()
        n = sum(a * b for a, b in lin.values())
        if self.qkv_bias:
            n += lin["q_proj"][1] + lin["k_proj"][1] + lin["v_proj"][1]
        if self.o_bias:
            n += self.hidden_size
        if self.mlp_bias:
            n += 2 * self.intermediate_size + self.hidden_size
        n += 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return n

    def param_shapes(self) -> list[tuple[int, ...]]:
        """The parameter shapes in module order (embeddings, each layer's attention, MLP and norms, final norm,
        lm_head when untied; parameters outside the Llama layout as one 1-D tensor at the end)."""
        h = self.hidden_size
        layer: list[tuple[int, ...]] = []
        for name, (fan_in, fan_out) in self.linear_shapes().items():
            layer.append((fan_out, fan_in))
            if (self.qkv_bias and name in ("q_proj", "k_proj", "v_proj")) or (self.o_bias and name == "o_proj"):
                layer.append((fan_out,))
            if self.mlp_bias and name in ("gate_proj", "up_proj", "down_proj"):
                layer.append((fan_out,))
            if self.qk_norm and name == "o_proj":  # Qwen3's q_norm and k_norm
                layer += [(self.head_dim,), (self.head_dim,)]
        layer += [(h,), (h,)]
        shapes = [(self.vocab_size, h), *layer * self.num_layers, (h,)]
        shapes += [] if self.tie_word_embeddings else [(self.vocab_size, h)]
        shapes += [(self.extra_params,)] if self.extra_params else []
        return shapes

    @property
    def root_params(self) -> int:
        """Embeddings + final norm + lm_head (when not tied to the embeddings): the FSDP root unit."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size + self.extra_params

    @property
    def num_params(self) -> int:
        return self.root_params + self.num_layers * self.layer_params

    def lora_params(self, rank: int, target_modules: Any = "all-linear") -> int:
        """Adapter parameters of LoRA rank ``rank`` (``r x (in + out)`` per adapted linear of every layer)."""
        lin = self.linear_shapes()
        if target_modules in (None, "all-linear", "all_linear"):
            names = list(_LINEARS)
        else:
            names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        per_layer = sum(rank * (lin[n][0] + lin[n][1]) for n in names if n in lin)
        return per_layer * self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes of one token over all layers (keys and values)."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def activation_bytes_per_token(self, gradient_checkpointing: bool, every: int = 1, liger: bool = False) -> float:
        """Saved bf16 activations of one token through the whole decoder (see the module docstring); ``every``:
        only the layers of index ``% every == 0`` are checkpointed (``model.gradient_checkpointing_every``);
        ``liger``: the decoder runs liger-kernel's RMSNorm and SwiGLU (``model.use_liger``)."""
        h, kv, i = self.hidden_size, self.kv_dim, self.intermediate_size
        one_layer = (16 * h + 6 * kv + 6 * i) if liger else (24 * h + 6 * kv + 8 * i)
        if gradient_checkpointing:
            checkpointed = math.ceil(self.num_layers / max(1, every))
            return checkpointed * 2 * h + (self.num_layers - checkpointed) * one_layer + one_layer
        return self.num_layers * one_layer


def count_params_on_meta(config: Any) -> int:
    """Exact parameter count of ``AutoModelForCausalLM.from_config(config)`` built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
