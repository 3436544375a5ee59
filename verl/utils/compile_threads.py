"""Parallel inductor compilation in a process that also hosts vLLM.

``import vllm`` sets ``TORCHINDUCTOR_COMPILE_THREADS=1`` for the whole process (``vllm/env_override.py``, for its
own compile workers). torch reads that variable when ``torch._inductor.config`` is first imported, so in a training
worker that builds an in-process vLLM engine every later inductor compile of the *training* side
(flex_attention and its block mask under ``attn_implementation=flex_attention``) compiles its Triton kernels one
at a time in the worker instead of in torch's pool of compile processes. Measured on one H200 (Qwen2.5-1.5B shape,
packed rows, 2026-12-02): the first old-log-prob pass of a training step was still compiling after 5 minutes,
while the same actor passes without vLLM in the process compiled and ran in 44 s.

``import verl`` records the user's own setting (``remember_user_setting``, before vLLM can change it; the record
is an environment variable, so Ray workers started from the driver inherit it). After the engine is built,
``restore_after_vllm`` gives inductor torch's default thread count back, unless the user had set
``TORCHINDUCTOR_COMPILE_THREADS`` themselves (then their value stands). vLLM's own start-up compile runs before
the restore and keeps vLLM's setting; the environment variable is left as vLLM set it for any process vLLM
starts.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

__all__ = ["USER_SETTING_ENV", "remember_user_setting", "restore_after_vllm"]

logger = logging.getLogger(__name__)

COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
# what TORCHINDUCTOR_COMPILE_THREADS was when verl was first imported in this process tree ("" = unset)
USER_SETTING_ENV = "VERL_USER_TORCHINDUCTOR_COMPILE_THREADS"


def remember_user_setting() -> None:
    """Record the user's ``TORCHINDUCTOR_COMPILE_THREADS`` once per process tree (a child keeps its parent's)."""
    if USER_SETTING_ENV not in os.environ:
        os.environ[USER_SETTING_ENV] = os.environ.get(COMPILE_THREADS_ENV, "")


def usable_cpus() -> int:
    """The CPUs this process may run on, as inductor counts them: ``torch._utils.cpu_count()`` where torch has it
    (2.13), else the scheduler affinity, else ``os.cpu_count()`` (torch 2.11 has no ``torch._utils.cpu_count``)."""
    import torch

    counter = getattr(torch._utils, "cpu_count", None)
    if counter is not None:
        return int(counter() or 1)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def restore_after_vllm() -> Optional[int]:
    """Give inductor its default compile threads back after vLLM forced one; returns the new count or None.

    Nothing changes when the user set ``TORCHINDUCTOR_COMPILE_THREADS`` (recorded by ``remember_user_setting``)
    or when inductor already compiles in parallel.
    """
    if os.environ.get(USER_SETTING_ENV, ""):
        return None
    import torch._inductor.config as inductor_config

    current = inductor_config.compile_threads
    if current is not None and current > 1:
        return None
    threads = min(32, usable_cpus())  # torch's own default (decide_compile_threads)
    if threads <= 1:
        return None
    inductor_config.compile_threads = threads
    logger.info(
        "inductor compile threads: %s -> %d (vLLM sets %s=1 for the process; the training side compiles "
        "flex_attention in parallel; set %s yourself to choose)",
        current,
        threads,
        COMPILE_THREADS_ENV,
        COMPILE_THREADS_ENV,
    )
    return threads
