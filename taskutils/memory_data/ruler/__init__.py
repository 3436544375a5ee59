"""RULER long-context tasks with the question and the haystack stored separately (docs/spec.md#ruler-tasks).

``python -m taskutils.memory_data.ruler --tasks niah_single_1,vt --lengths 8192,16384 \\
--tokenizer PATH --out DIR`` writes ``DIR/eval_{task}_{length}.json``; see
:mod:`taskutils.memory_data.ruler.cli`. :func:`generate_sample` makes one record in memory.
"""

from __future__ import annotations

from typing import Any

from taskutils.memory_data.ruler.common import RulerResources
from taskutils.memory_data.ruler.constants import DEFAULT_LENGTHS, DEFAULT_TASKS, TASKS
from taskutils.memory_data.ruler.niah import generate_niah
from taskutils.memory_data.ruler.qa import generate_qa
from taskutils.memory_data.ruler.variable_tracking import generate_variable_tracking
from taskutils.memory_data.ruler.words import generate_cwe, generate_fwe

GENERATORS = {
    "niah": generate_niah,
    "variable_tracking": generate_variable_tracking,
    "common_words_extraction": generate_cwe,
    "freq_words_extraction": generate_fwe,
    "qa": generate_qa,
}


def generate_sample(task: str, index: int, max_length: int, res: RulerResources) -> dict[str, Any]:
    """Record ``index`` of ``task`` at ``max_length`` tokens: index, input, context, outputs,
    answer_prefix, length (= question + context tokens + the task's generation budget)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {sorted(TASKS)}")
    generator, kwargs = TASKS[task]
    return GENERATORS[generator](task, index, max_length, res, **kwargs)


__all__ = ["DEFAULT_LENGTHS", "DEFAULT_TASKS", "GENERATORS", "TASKS", "RulerResources", "generate_sample"]
