"""The policy model section ``actor_rollout_ref.model`` (the actor, the ref model and the rollout engine load it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["FusedKernelOptionsConfig", "ModelConfig"]


@dataclass
class FusedKernelOptionsConfig(BaseConfig):
    """``actor_rollout_ref.model.fused_kernel_options``."""

    SECTION = "actor_rollout_ref.model.fused_kernel_options"

    # torch: chunked PyTorch (CPU and GPU) | triton (alias liger): liger-kernel on CUDA for no-grad passes.
    impl_backend: str = "torch"
    # Tokens per chunk of the fused log-prob head.
    chunk_size: int = 1024

    def check(self, c: Checks) -> None:
        from verl.workers.actor.fused_logprob import FUSED_BACKENDS

        c.choice("impl_backend", FUSED_BACKENDS)
        c.integer("chunk_size", 1)


@dataclass
class ModelConfig(BaseConfig):
    """``actor_rollout_ref.model``."""

    SECTION = "actor_rollout_ref.model"

    # HF model folder (or hub id resolvable offline) of the base model.
    path: str = "~/models/deepseek-llm-7b-chat"
    # Python module to import before loading the model.
    external_lib: Optional[str] = None
    # Overrides of the HF model config for the actor, the ref model and the rollout engine.
    override_config: dict = field(default_factory=dict)
    # Activation checkpointing in the actor/ref forward.
    enable_gradient_checkpointing: bool = True
    # Checkpoint every N-th decoder layer only (index % N == 0); 1 = every layer. Needs enable_gradient_checkpointing.
    gradient_checkpointing_every: int = 1
    # Unpad sequences (varlen attention) in training forward passes.
    use_remove_padding: bool = False
    # Packed rows with identical prompts (a GRPO group's first turn) hold the prompt once; same numbers, fewer tokens.
    share_prompts: bool = True
    # Attention kernel; null = flash_attention_2 when installed on CUDA, else on CUDA with use_remove_padding
    # torch_varlen (torch >= 2.10, Ampere+, no sliding window or attention dropout) or flex_attention, else sdpa.
    attn_implementation: Optional[str] = None
    # LoRA rank; 0 = full fine-tuning (> 0: peft adapters train, the base is frozen, the rollout gets merged weights).
    lora_rank: int = 0
    # LoRA alpha (scaling = lora_alpha / lora_rank).
    lora_alpha: int = 16
    # Modules LoRA adapts: "all-linear" or a list of linear module names (not embeddings nor a tied lm_head).
    target_modules: Any = "all-linear"
    # liger-kernel fused RMSNorm/SwiGLU/RoPE; null = on with CUDA, liger installed, compile_layers off, a model it patches.
    use_liger: Optional[bool] = None
    # torch.compile each decoder layer (regional compilation; actor and ref model); off by default.
    compile_layers: bool = False
    # Log-probs and entropy from the last hidden states a chunk of tokens at a time (no [tokens, vocab] logits).
    use_fused_kernels: bool = True
    # Options of the fused log-prob head.
    fused_kernel_options: FusedKernelOptionsConfig = field(default_factory=FusedKernelOptionsConfig)
    # Allow custom modelling code shipped with the checkpoint (tokenizer, actor, ref, rollout engine).
    trust_remote_code: bool = False

    def check(self, c: Checks) -> None:
        c.integer("lora_rank", 0)
        c.integer("gradient_checkpointing_every", 1)
        c.integer("lora_alpha", 1)
        modules = self.target_modules
        names = [modules] if isinstance(modules, str) else modules
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            c.error(
                f"{c.key('target_modules')} must be 'all-linear' or a non-empty list of module names "
                f"(e.g. [q_proj, v_proj]), got {modules!r}"
            )
        if not self.path and "path" not in c.bad:
            c.error(f"{c.key('path')} must name the model folder (got {self.path!r})")

    @property
    def lora(self) -> Optional[dict]:
        """The LoRA options of ``load_causal_lm``, or None for full fine-tuning."""
        if self.lora_rank <= 0:
            return None
        return {"r": self.lora_rank, "lora_alpha": self.lora_alpha, "target_modules": self.target_modules}
