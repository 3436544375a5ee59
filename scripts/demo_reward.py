"""The CPU demo's reward: the strict training verifier, plus partial credit a 135M model can earn.

* 1.0  the last ``\\boxed{}`` holds a gold answer (the strict MemAgent training verifier);
* 0.5  otherwise, a gold answer appears in the final answer (normalised containment, like the
       lenient evaluation metric): SmolLM2-135M often answers right without the box;
* 0.0  otherwise.

Passed to the trainer as ``custom_reward_function.path=scripts/demo_reward.py``; the real recipes
(run_memory_*.sh) use the strict verifier alone.
"""

from verl.utils.reward_score import hotpotqa
from verl.utils.reward_score.lenient import normalize_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if hotpotqa.compute_score(solution_str, ground_truth) == 1.0:
        return 1.0
    golds = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    text = normalize_answer(solution_str or "")
    return 0.5 if any(normalize_answer(str(g)) and normalize_answer(str(g)) in text for g in golds) else 0.0
