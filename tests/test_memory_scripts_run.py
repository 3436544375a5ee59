"""Issue 15's acceptance: the original ``run_memory_7B.sh`` and ``run_memory_14B.sh`` override lists run (CPU, tiny
model, scaled down) with no key silently dropped.

Each script's override list is its ``DRY_RUN=1`` output (``tests/test_config.py::script_overrides``) with the
script's own environment pointing at a tiny model and tiny memory-task files laid out where the script expects
them (``$DATASET_ROOT/hotpotqa/hotpotqa_{train_32k,dev}.parquet``). :data:`SCALE_DOWN` is appended (Hydra: the last
value of a key wins); it only changes sizes and the hardware, never drops or adds a behaviour key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import open_dict

import verl.trainer.config_keys as config_keys
import verl.trainer.main_ppo as main_ppo
from tests.test_config import compose_config, script_overrides
from tests.test_trainer_e2e import _data
from verl.trainer.config_preflight import check_config
from verl.trainer.config_schema import apply_config_aliases, validate_config

REPO = Path(__file__).resolve().parent.parent

# 32 GPUs (7B) / 256 GPUs (14B) -> one CPU process (14B: two, see TP_14B); vLLM -> the HF engine; batch sizes 2;
# the memory agent's 5000-token chunks -> 24 tokens over at most 4 chunks; 1 step, no wandb.
SCALE_DOWN = [
    "trainer.device=cpu",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.logger=[console]",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "data.max_prompt_length=512",
    "data.max_response_length=16",
    "recurrent.memory.config.chunk_size=24",
    "recurrent.memory.config.max_memorization_length=8",
    "recurrent.memory.config.max_final_response_length=8",
    "recurrent.memory.config.max_chunks=4",
    "recurrent.memory.config.max_prompt_length=32",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=False",
]

# run_memory_14B.sh's vLLM engine with its tensor_model_parallel_size=2: one engine shared by two CPU ranks
TP_14B = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.enforce_eager=True",  # no torch.compile of the engine on 2 CPU cores
    "actor_rollout_ref.rollout.max_num_seqs=16",
]


def justified_in_differences(key: str) -> bool:
    doc = (REPO / "docs" / "differences.md").read_text()
    return f"`{key}`" in doc[doc.index("## Keys the launch scripts set that do nothing") :]


@pytest.mark.slow
def test_memory_scripts_run_one_scaled_down_step(tiny_model_path, tmp_path, monkeypatch, ray_cluster):
    """Both scripts train one step on CPU; the start-up table of inert keys holds only keys justified in
    docs/differences.md (today: data.context_key).

    run_memory_14B.sh sets ``rollout.tensor_model_parallel_size=2`` with vLLM: its list as written passes the launch
    checks (``validate_config``, ``config_preflight``), and its scaled-down run keeps vLLM with TP 2 on two CPU ranks
    sharing one engine (``verl/workers/rollout/tp_layout.py``); everything else it sets (batch 256 / mini-batch 16 /
    fsdp_size 16 before scaling) takes the same path as the 7B run.
    """
    data = tmp_path / "data" / "hotpotqa"
    data.mkdir(parents=True)
    _data(data, 4, "hotpotqa_train_32k")
    _data(data, 2, "hotpotqa_dev")
    tables = []
    check = config_keys.check_config_keys
    monkeypatch.setattr(config_keys, "check_config_keys", lambda cfg: tables.append(check(cfg)) or tables[-1])

    def overrides(script: str) -> list[str]:
        return script_overrides(script, tmp_path, MODEL_PATH=str(tiny_model_path))

    original_14b = overrides("run_memory_14B.sh")
    as_written = compose_config(original_14b)
    assert as_written.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    validate_config(as_written)  # the launch checks of main_ppo.run, in its order
    with open_dict(as_written):
        apply_config_aliases(as_written)
    check_config(as_written)
    runs = {
        "run_memory_7B.sh": overrides("run_memory_7B.sh") + SCALE_DOWN,
        "run_memory_14B.sh": original_14b + SCALE_DOWN + TP_14B,
    }
    for script, args in runs.items():
        tables.clear()
        history = main_ppo.run(compose_config(args))
        assert [h["step"] for h in history] == [1], script
        step = history[0]
        assert step["trajectory/count"] == 4  # 2 questions x rollout.n 2
        assert step["trajectory/num_conv/max"] >= 2  # memory turns over the chunks, then the final answer
        assert step["actor/num_mini_batches"] == 1 and step["actor/lr"] > 0
        assert "val-core/hotpotqa/reward/mean@1" in step  # the last step validates (test_freq=5)
        name = script.removeprefix("run_memory_").removesuffix(".sh")
        assert (tmp_path / "proj" / "memory_agent" / name / "global_step_1").is_dir()  # save_freq=10: last step
        (table,) = tables
        assert [i.key for i in table] == ["data.context_key"], script
        assert all(justified_in_differences(i.key) for i in table)
