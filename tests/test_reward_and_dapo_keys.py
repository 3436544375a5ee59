"""Keys of issue 15 item 3 reaching code (evidence for tests/test_config_contract.py's CONSUMED table):
``reward_model.reward_kwargs`` and ``data.reward_fn_key`` (the scorer's keyword arguments and routing column),
``algorithm.filter_groups.metric`` and ``data.gen_batch_size`` (DAPO dynamic sampling), and
``actor_rollout_ref.model.external_lib`` / ``critic.model.external_lib`` (imported before a model loads)."""

from __future__ import annotations

import sys
import types
import uuid

import numpy as np
import pandas as pd
import pytest
import torch

from tests.test_config import compose_config
from tests.test_config_consumed_run import FIXTURES, recorded_run  # noqa: F401  (recorded_run: a fixture)
from verl.protocol import DataProto
from verl.trainer.config import from_config
from verl.trainer.config_schema import ConfigError

# ------------------------------------------------------------------------------------------------ reward


def _reward_rows(path, sources):
    rows = [
        {
            "data_source": "hotpotqa",
            "task": source,
            "prompt": [{"role": "user", "content": f"question {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": "7"},
        }
        for i, source in enumerate(sources)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _answers(tokenizer, texts, sources, truth="7"):
    """A scored batch as the trainers hand it to a reward manager: responses + per-row columns."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    col = {
        "data_source": np.array(["hotpotqa"] * len(texts), dtype=object),
        "task": np.array(sources, dtype=object),
        "reward_model": np.array([{"ground_truth": truth}] * len(texts), dtype=object),
    }
    return DataProto.from_dict({"responses": responses, "response_mask": mask}, col)


def test_reward_kwargs_and_reward_fn_key_reach_the_scorer(recorded_run, tmp_path):  # noqa: F811
    """main_ppo.run hands both keys to the reward managers; the managers pass reward_kwargs to the scorer
    (custom or built-in) and the reward_fn_key column as its data_source."""
    from transformers import AutoTokenizer

    from verl.workers.reward_manager import get_reward_manager_cls  # load_reward_manager is the recorder here

    train = _reward_rows(tmp_path / "t.parquet", ["gsm8k", "gsm8k"])
    seen = recorded_run(
        f"data.train_files={train}",
        f"data.val_files={train}",
        "data.reward_fn_key=task",
        "+reward_model.reward_kwargs.format_score=0.25",
        "+reward_model.reward_kwargs.score=2.0",
    )
    train_kw, val_kw = seen["reward_kwargs"]
    assert train_kw == val_kw == {"reward_fn_key": "task", "format_score": 0.25, "score": 2.0}
    (name, custom), _ = seen["reward"]
    assert custom is None  # the built-in, routed by the task column: gsm8k's scorer takes format_score/score
    tok = AutoTokenizer.from_pretrained(seen["cfg"].actor_rollout_ref.model.path)
    batch = _answers(tok, ["so #### 7", "so #### 8", "no answer"], ["gsm8k"] * 3)
    scores, _ = get_reward_manager_cls(name)(tok, **train_kw)(batch)
    assert scores.tolist() == [2.0, 0.25, 0.0]
    # the default routing reads data_source (hotpotqa: boxed exact match), where the kwargs mean nothing
    default_scores, _ = get_reward_manager_cls(name)(tok)(batch)
    assert default_scores.tolist() == [0.0, 0.0, 0.0]

    # a custom scorer gets them too, with the reward_fn_key column as data_source
    calls = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        calls.append((data_source, kwargs))
        return 1.0

    get_reward_manager_cls("naive")(tok, compute_score=scorer, reward_fn_key="task", bonus=3)(batch[:1])
    assert calls == [("gsm8k", {"bonus": 3})]


def test_reward_fn_key_is_checked_at_launch(recorded_run, tmp_path):  # noqa: F811
    train = _reward_rows(tmp_path / "t.parquet", ["gsm8k", "nope_source"])
    with pytest.raises(ConfigError, match=r"field task='nope_source' has no reward scorer"):
        recorded_run(f"data.train_files={train}", "data.reward_fn_key=task")
    with pytest.raises(ConfigError, match=r"missing column 'topic' .*data.reward_fn_key"):
        recorded_run(f"data.train_files={train}", "data.reward_fn_key=topic")


# ------------------------------------------------------------------------------------------------ DAPO

# per prompt: the verifier's scores, the final answers' lengths (overlong penalty past 4 of 8 tokens) and the
# scorer's extra "acc", for n=2 trajectories each
GROUPS = {
    0: {"score": [1.0, 1.0], "length": [2, 8], "acc": [0.0, 1.0]},  # reward varies (penalty), score does not
    1: {"score": [1.0, 0.0], "length": [2, 2], "acc": [1.0, 1.0]},  # score and reward vary, acc does not
    2: {"score": [0.0, 1.0], "length": [2, 2], "acc": [0.0, 1.0]},  # everything varies
    3: {"score": [0.0, 1.0], "length": [2, 2], "acc": [1.0, 0.0]},
}


def _dapo_trainer(*overrides):
    """A MultiConvTrainer whose rollout is scripted by GROUPS (one conversation per trajectory)."""
    from verl.trainer.ppo.ray_trainer import MultiConvTrainer
    from verl.utils.conversation_batch import build_conversation_batch

    trainer = object.__new__(MultiConvTrainer)
    cfg = compose_config(
        [
            "recurrent.enable=memory",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.max_num_gen_batches=1",
            "algorithm.overlong_buffer.enable=True",
            "algorithm.overlong_buffer.len=4",
            *overrides,
        ]
    )
    trainer.config, trainer.conf = cfg, from_config(cfg)
    trainer.workflow = types.SimpleNamespace(final_response_length=8)

    def rollout_and_score(batch, n, validate, timing, step=None):
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        traj = batch.repeat(n, interleave=True)
        pids = traj.non_tensor_batch["pid"].tolist()
        slot = [i % n for i in range(len(pids))]
        lengths = [GROUPS[p]["length"][s] for p, s in zip(pids, slot)]
        mask = torch.tensor([[1] * k + [0] * (8 - k) for k in lengths])
        conv = DataProto.from_dict(
            build_conversation_batch([[5]] * len(pids), [[1] * k for k in lengths], 0, response_width=8),
            meta_info={"pad_token_id": 0},
        )
        finals = DataProto.from_dict({"responses": mask.clone(), "response_mask": mask})
        finals.meta_info["reward_extra_info"] = {"acc": [GROUPS[p]["acc"][s] for p, s in zip(pids, slot)]}
        scores = torch.tensor([GROUPS[p]["score"][s] for p, s in zip(pids, slot)])
        index = torch.arange(len(pids))
        return traj, conv, torch.ones(len(pids), dtype=torch.bool), index, scores, finals

    trainer.rollout_and_score = rollout_and_score
    return trainer


def _prompts(pids):
    return DataProto.from_dict(non_tensors={"pid": np.array(pids, dtype=object)})


def _kept(trainer, pids):
    metrics = {}
    traj, _, _, _, scores = trainer.collect_rollouts(_prompts(pids), 2, None, {}, metrics)
    return sorted(set(traj.non_tensor_batch["pid"].tolist())), scores, metrics


def test_filter_groups_metric_picks_what_must_vary():
    """score: the verifier's (before the overlong penalty); reward: after it; acc: a key of the scorer's dict."""
    assert _kept(_dapo_trainer("data.train_batch_size=2", "algorithm.filter_groups.metric=score"), [0, 1])[0] == [1]
    kept, rewards, _ = _kept(_dapo_trainer("data.train_batch_size=2", "algorithm.filter_groups.metric=reward"), [0, 1])
    assert kept == [0, 1]
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # the step trains on the shaped rewards whatever the metric
    assert _kept(_dapo_trainer("data.train_batch_size=2", "algorithm.filter_groups.metric=acc"), [0, 1])[0] == [0]
    with pytest.raises(KeyError, match=r"algorithm.filter_groups.metric='pass'.*they have: acc"):
        _kept(_dapo_trainer("data.train_batch_size=2", "algorithm.filter_groups.metric=pass"), [0, 1])


def test_dynamic_sampling_draws_generation_batches_until_enough_groups_vary():
    """max_num_gen_batches=0 is no limit: batches are drawn until train_batch_size groups survive (counted in
    train/num_gen_batches); a limit of 1 stops after the first batch with what it kept."""
    for limit, want in ((0, ([1, 2, 3], 2)), (1, ([1], 1))):
        more = iter([_prompts([2, 3])])  # one more generation batch on offer
        trainer = _dapo_trainer(
            "data.train_batch_size=3",
            "algorithm.filter_groups.metric=score",
            f"algorithm.filter_groups.max_num_gen_batches={limit}",
        )
        metrics = {}
        traj, *_ = trainer.collect_rollouts(_prompts([0, 1]), 2, more.__next__, {}, metrics)
        kept = sorted(set(traj.non_tensor_batch["pid"].tolist()))
        assert (kept, metrics["train/num_gen_batches"]) == want, limit


def test_gen_batch_size_draws_more_prompts_than_the_step_trains_on(tmp_path):
    """data.gen_batch_size prompts per generation batch; the step keeps data.train_batch_size groups."""
    from verl.utils.dataset.sampler import train_dataloader

    gen = ["data.train_batch_size=2", "data.gen_batch_size=4"]
    trainer = _dapo_trainer(*gen)
    loader = train_dataloader(list(range(8)), trainer.conf.data, collate_fn=list)
    assert [len(b) for b in loader] == [4, 4]
    kept, _, metrics = _kept(trainer, [0, 1, 2, 3])  # 3 groups survive, the first 2 are trained on
    assert kept == [1, 2] and metrics["train/kept_groups"] == 3 and metrics["train/num_gen_batches"] == 1
    assert len(train_dataloader(list(range(8)), from_config(compose_config(gen[:1])).data, list)) == 4  # null
    # without the DAPO filter the update would not match the batch: refused before anything loads
    from verl.trainer.config_schema import validate_config

    def gen_errors(*overrides):
        with pytest.raises(ConfigError) as err:  # other keys of the bare YAML are invalid in recurrent mode too
            validate_config(compose_config(["recurrent.enable=memory", *overrides]))
        return [m for m in err.value.errors if "gen_batch_size" in m]

    assert gen_errors(*gen) == [
        "data.gen_batch_size=4 differs from data.train_batch_size=2: that needs algorithm.filter_groups.enable=True "
        "in recurrent mode (generation batches are drawn until train_batch_size groups survive the filter); set "
        "data.gen_batch_size=null otherwise"
    ]
    assert gen_errors("algorithm.filter_groups.enable=True", *gen) == []


# ------------------------------------------------------------------------------------------------ external_lib

PROBE = "tests.fixtures.external_lib_probe"


def test_external_lib_is_imported_before_the_models_load(tiny_model_path, monkeypatch):
    """The actor/ref/rollout worker and the critic worker import model.external_lib before loading weights; the
    probe module records the order (it runs a line at import)."""
    import verl.utils.model_loading as model_loading
    import verl.workers.critic.critic_worker as critic_worker
    from verl.workers.critic.critic_worker import CriticWorker
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    events = []

    class Loaded(Exception):
        pass

    def stop_at_load(*args, **kwargs):
        events.append(("load", PROBE in sys.modules))
        raise Loaded

    monkeypatch.setattr(model_loading, "load_causal_lm", stop_at_load)
    monkeypatch.setattr(critic_worker, "load_value_model", stop_at_load)
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"actor_rollout_ref.model.external_lib={PROBE}",
            "algorithm.adv_estimator=gae",
        ]
    )
    for build in (lambda: ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu"), lambda: CriticWorker(cfg.critic, "cpu")):
        sys.modules.pop(PROBE, None)
        with pytest.raises(Loaded):
            build().init_model()
        assert events.pop() == ("load", True)
    sys.modules.pop(PROBE, None)
    cfg.actor_rollout_ref.model.external_lib = None
    with pytest.raises(Loaded):
        ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu").init_model()
    assert events.pop() == ("load", False)  # the key is what imports it
