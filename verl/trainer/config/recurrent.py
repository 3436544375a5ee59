"""The ``recurrent`` section (multi-conversation agent workflows): its two typed keys.

The workflow sub-configs (``recurrent.memory``, ``recurrent.tool_gsm8k``, ...) are free-form: their ``config``
holds the keyword arguments of the workflow's own config class, which the provider builds and validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config.base import BaseConfig

__all__ = ["RecurrentConfig", "RECURRENT_OFF"]

# Values of recurrent.enable that mean "off".
RECURRENT_OFF = (None, False, "", "false", "False", "none", "None", "null")


@dataclass
class RecurrentConfig(BaseConfig):
    """``recurrent.enable`` and ``recurrent.provider`` (``validate_config`` checks the named sub-config)."""

    SECTION = "recurrent"

    # NAME of the workflow sub-config to activate (memory | tool_gsm8k | trival); False or null = off.
    enable: Any = False
    # Python function (module:function) that builds the active workflow for the multi-turn trainer.
    provider: str = "recurrent.workflow_provider:build_workflow"

    @property
    def name(self) -> Optional[str]:
        """The selected workflow's name, or None when off."""
        return None if self.enable in RECURRENT_OFF or not isinstance(self.enable, str) else self.enable
