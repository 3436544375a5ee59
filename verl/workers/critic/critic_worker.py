"""The critic (value model) worker: one process per GPU (or per CPU slot), driven through a worker group.

The value model is the causal LM backbone of ``critic.model.path`` plus a scalar head:
``AutoModelForTokenClassification`` with ``num_labels=1`` (transformers has ``Qwen2ForTokenClassification``,
``LlamaForTokenClassification``, ... : the backbone weights load from a causal-LM checkpoint and only the head
``score`` is new). The head's dropout is switched off (``classifier_dropout=0``) so values are deterministic
in training mode. The critic must share the policy's tokenizer (it reads the actor's token ids).

Sharding, optimizer and LR schedule follow the actor worker (``verl.workers.fsdp_workers``): FSDP2 when there is
more than one rank or a GPU, fp32 master weights (bf16 compute on GPU), AdamW.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from verl.protocol import DataProto
from verl.single_controller import Dispatch, register
from verl.workers.actor.settings import plain_values
from verl.workers.config import CriticConfig
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.training_worker import TrainingWorker

__all__ = ["CriticWorker", "load_value_model"]

logger = logging.getLogger(__name__)


def load_value_model(
    path: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype, None] = "float32",
    attn_implementation: Optional[str] = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    override_config: Optional[dict[str, Any]] = None,
    device: Union[str, torch.device, None] = None,
    remove_padding: bool = False,
) -> nn.Module:
    """Load a causal-LM checkpoint folder as a value model (backbone + scalar head, ``num_labels=1``).

    ``override_config`` sets config attributes (e.g. ``{"classifier_dropout": 0.1}`` to re-enable head dropout).
    Raises ``FileNotFoundError`` for a path that is not a local folder and ``ValueError`` for an architecture
    without a transformers ``...ForTokenClassification`` class.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    from verl.utils.model_loading import prepare_for_training, resolve_attn_implementation, resolve_dtype

    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"critic.model.path '{path}' is not a local folder (nothing is downloaded at run time)")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    for key, value in (override_config or {}).items():
        setattr(config, key, value)
    # torch_varlen (or flex_attention) for packed rows on CUDA
    attn = resolve_attn_implementation(
        attn_implementation, device, remove_padding, model_config=config, section="critic.model"
    )
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=resolve_dtype(dtype),
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )
    except ValueError as err:
        if "Unrecognized configuration class" in str(err):
            raise ValueError(
                f"critic.model.path '{path}': architecture {getattr(config, 'model_type', '?')!r} has no "
                "transformers ...ForTokenClassification class to build a value model from"
            ) from err
        raise
    if device is not None:
        model.to(device)
    return prepare_for_training(model, gradient_checkpointing)


class CriticWorker(TrainingWorker):
    """The value model of one rank. ``config`` is the ``critic`` section (read through the typed ``self.conf``,
    :class:`~verl.workers.config.CriticConfig`); ``device`` is ``cpu`` or ``cuda``."""

    CONFIG_CLS = CriticConfig

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the value model, shard it, build AdamW, the LR schedule and the ``DataParallelPPOCritic``."""
        from verl.utils.fsdp_utils import apply_fsdp2, build_optim_and_scheduler, init_fsdp_mesh
        from verl.utils.import_utils import import_external_libs

        self._init_distributed()
        cfg = self.conf
        model_cfg = cfg.model
        # the same seed on every rank: the new value head starts identical everywhere
        torch.manual_seed(cfg.seed)
        device = torch.device("cuda" if self.device_name == "cuda" else "cpu")
        self.model_path = os.path.expanduser(model_cfg.path)
        import_external_libs(model_cfg.external_lib)  # critic.model.external_lib: registers custom architectures
        module = load_value_model(
            self.model_path,
            dtype="float32",
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            trust_remote_code=bool(model_cfg.trust_remote_code),  # null: the YAML makes it follow the policy's
            override_config=model_cfg.override_config or None,
            remove_padding=bool(model_cfg.use_remove_padding),
            device=device,  # the automatic attention is the worker device's
        )
        if self.world_size > 1 or self.device_name == "cuda":  # HSDP when fsdp_size divides the world size
            mesh = init_fsdp_mesh(
                model_cfg.fsdp_config.fsdp_size,
                device_type=self.device_name,
                world_size=self.world_size,
                key="critic.model.fsdp_config.fsdp_size",
            )
            module = apply_fsdp2(
                module,
                mesh=mesh,
                param_dtype="bfloat16" if self.device_name == "cuda" else None,
                reshard_after_forward=model_cfg.fsdp_config.reshard_after_forward,
            )
        self.optimizer, self.lr_scheduler = build_optim_and_scheduler(module, cfg.optim)
        settings = {**plain_values(cfg), "use_remove_padding": model_cfg.use_remove_padding}
        self.critic_module = module
        self.critic = DataParallelPPOCritic(settings, module, self.optimizer)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` ``[B, R]`` of this rank's rows (see ``DataParallelPPOCritic.compute_values``)."""
        from verl.utils.fsdp_utils import reshard_fsdp

        values = self.critic.compute_values(data)
        if not self.conf.model.fsdp_config.reshard_after_forward:  # the forward-only pass leaves them gathered
            reshard_fsdp(self.critic_module)
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRICS)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """One value update over this rank's rows; metrics are global (identical on every rank)."""
        from verl.workers.memory_peaks import memory_metrics

        metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics.update({k.replace("perf/", "perf/critic_"): v for k, v in memory_metrics(self.device_name).items()})
        self.lr_scheduler.step()
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded model, optimizer, LR schedule and RNG state into ``path`` (every rank)."""
        from verl.utils.checkpoint import save_model_shards

        save_model_shards(
            path,
            self.critic_module,
            self.optimizer,
            self.lr_scheduler,
            rank=self.rank,
            world_size=self.world_size,
            hf_source_path=self.model_path,
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Load what ``save_checkpoint`` wrote (any number of ranks: DCP reshards)."""
        from verl.utils.checkpoint import load_model_shards

        load_model_shards(
            path, self.critic_module, self.optimizer, self.lr_scheduler, rank=self.rank, world_size=self.world_size
        )
