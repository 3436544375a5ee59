"""Upstream verl 0.9 call forms for the modules we share (issue 19): imports, positional and keyword
signatures, and the numbers they give on small hand-computed inputs. docs/differences.md lists what
still differs, with reasons."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

# ------------------------------------------------------------------ DataProto


def _proto(num_rows: int = 4, meta: dict | None = None):
    from verl import DataProto

    return DataProto.from_dict(
        tensors={"obs": torch.arange(num_rows * 2).view(num_rows, 2)},
        non_tensors={"uid": [f"u{i}" for i in range(num_rows)]},
        meta_info=meta or {"temperature": 1.0},
    )


def test_top_level_exports():
    import verl
    from verl import DataProto, DataProtoItem
    from verl.protocol import DataProto as ProtocolDataProto

    assert DataProto is ProtocolDataProto
    assert "DataProto" in verl.__all__ and isinstance(verl.__version__, str)
    assert isinstance(_proto()[0], DataProtoItem)


def test_import_verl_leaves_torch_to_the_first_data_proto_use():
    """``import verl`` alone (a torch-free Ray worker of verl.single_controller) does not import torch/tensordict;
    the names resolve on first use (here, in this process, where verl.protocol is loaded already)."""
    import verl
    import verl.protocol as protocol

    probe = "import sys, verl; assert 'torch' not in sys.modules and 'tensordict' not in sys.modules, 'eager'"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert verl.DataProto is protocol.DataProto and verl.DataProtoItem is protocol.DataProtoItem
    assert {"DataProto", "DataProtoItem"} <= set(dir(verl))
    assert not hasattr(verl, "NoSuchName")


def test_from_dict_keyword_forms():
    from verl import DataProto

    data = DataProto.from_dict(
        tensors={"obs": torch.zeros(3, 2)}, non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)},
        meta_info={"k": 1}, num_batch_dims=1, auto_padding=True,
    )  # fmt: skip
    assert len(data) == 3 and data.is_padding_enabled() and data.meta_info["k"] == 1
    assert not _proto().is_padding_enabled()
    assert DataProto.from_single_dict({"obs": torch.zeros(2, 1)}, auto_padding=True).is_padding_enabled()
    with pytest.raises(ValueError, match="num_batch_dims=1"):
        DataProto.from_dict(tensors={"obs": torch.zeros(2, 3)}, num_batch_dims=2)


def test_sample_level_repeat_all_count_types():
    data = _proto(3)
    for counts in ([2, 0, 1], (2, 0, 1), np.array([2, 0, 1]), torch.tensor([2, 0, 1])):
        out = data.sample_level_repeat(counts)
        assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u2"]
        assert out.batch["obs"].tolist() == [[0, 1], [0, 1], [4, 5]]
        assert out.meta_info == {"temperature": 1.0}
    with pytest.raises(ValueError, match="one count per row"):
        data.sample_level_repeat([1, 1])


def test_to_tensordict_holds_tensors_non_tensors_and_meta():
    td = _proto(3).to_tensordict()
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([3])
    assert td["obs"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert list(td["uid"]) == ["u0", "u1", "u2"]
    assert td["temperature"] == 1.0
    assert list(td[1:]["uid"]) == ["u1", "u2"]


def test_make_iterator_matches_a_seeded_dataloader():
    """Same mini-batches, in the same order, as verl's DataLoader-backed iterator (shuffle with a seed)."""
    from verl.protocol import collate_fn

    data = _proto(6)
    ours = [b.non_tensor_batch["uid"].tolist() for b in data.make_iterator(2, 2, 7, {"shuffle": True})]
    generator = torch.Generator()
    generator.manual_seed(7)
    loader = DataLoader(data, batch_size=2, shuffle=True, generator=generator, collate_fn=collate_fn)
    theirs = [b.non_tensor_batch["uid"].tolist() for _ in range(2) for b in loader]
    assert ours == theirs and len(ours) == 6
    assert sorted(sum(ours[:3], [])) == [f"u{i}" for i in range(6)]  # each epoch is a permutation
    plain = list(data.make_iterator(mini_batch_size=4, epochs=1))
    assert [b.non_tensor_batch["uid"].tolist() for b in plain] == [["u0", "u1", "u2", "u3"], ["u4", "u5"]]
    assert all(b.meta_info == {"temperature": 1.0} for b in plain)
    dropped = list(data.make_iterator(4, 1, dataloader_kwargs={"drop_last": True}))
    assert len(dropped) == 1


def test_concat_metrics_and_conflicts_upstream_style():
    from verl import DataProto

    a = _proto(2, {"temperature": 1.0, "metrics": {"loss": 1.0}})
    b = _proto(2, {"temperature": 1.0, "metrics": {"loss": 3.0}, "extra": "x"})
    joined = DataProto.concat([a, b])
    assert joined.meta_info == {"temperature": 1.0, "metrics": {"loss": [1.0, 3.0]}, "extra": "x"}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'temperature'"):
        DataProto.concat([a, _proto(2, {"temperature": 0.5})])


def test_select_idxs_slice_padding_and_helpers():
    from verl.protocol import list_of_dict_to_dict_of_list, union_tensor_dict

    data = _proto(4)
    assert data.select_idxs([3, 1]).non_tensor_batch["uid"].tolist() == ["u3", "u1"]
    assert data.select_idxs(np.array([True, False, False, True])).non_tensor_batch["uid"].tolist() == ["u0", "u3"]
    assert data.slice(1, 4, 2).non_tensor_batch["uid"].tolist() == ["u1", "u3"]
    data.padding(2, "first")
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3", "u0", "u0"]
    assert list_of_dict_to_dict_of_list([{"a": 1}, {"a": 2}]) == {"a": [1, 2]}
    left = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    assert sorted(union_tensor_dict(left, TensorDict({"y": torch.zeros(2)}, batch_size=[2])).keys()) == ["x", "y"]


# ------------------------------------------------------------------ core_algos: signatures and numbers

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # row sums 3 and 4, 3 tokens, 2 rows


def test_agg_loss_upstream_positional_and_keyword_forms():
    from verl.trainer.ppo.core_algos import agg_loss

    # positional (loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, scale)
    assert float(agg_loss(LOSS, MASK, "token-mean")) == pytest.approx(7 / 3)
    assert float(agg_loss(LOSS, MASK, "token-mean", 2, 14)) == pytest.approx(7 / 14 * 2)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum", 1, None, 4)) == pytest.approx(7 / 4)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-mean", 2, None, 4)) == pytest.approx((1.5 + 4) / 4 * 2)
    assert float(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", 1, None, None, 2.0)) == pytest.approx((1.5 + 2) / 2)
    # token-sum: the masked sum times dp_size, no normaliser
    assert float(agg_loss(LOSS, MASK, "token-sum")) == pytest.approx(7.0)
    assert float(agg_loss(loss_mat=LOSS, loss_mask=MASK, loss_agg_mode="token-sum", dp_size=4)) == pytest.approx(28.0)
    # our names are the same counts
    assert float(agg_loss(LOSS, MASK, "token-mean", global_token_count=14)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not both"):
        agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=3, global_token_count=3)


def test_reinforce_plus_plus_config_form_and_multi_turn_holes():
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_outcome_advantage as rpp

    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])  # two turns with a 2-token tool observation between
    _, returns = rpp(rewards, mask, config=SimpleNamespace(gamma=1.0))
    assert returns.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]  # carried across the hole, not reset
    # gamma 0.5: the hole neither discounts nor resets; G = 1, 0.5 | hole | 0.25, 0.125
    _, returns = rpp(rewards, mask, {"gamma": 0.5})
    assert returns.tolist() == [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]
    # the same numbers from all call forms
    for call in (lambda: rpp(rewards, mask, 0.5), lambda: rpp(rewards, mask, gamma=0.5)):
        assert call()[1].tolist() == [[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]
    adv, _ = rpp(rewards, mask, config={"gamma": 0.5})
    valid = torch.tensor([0.125, 0.25, 0.5, 1.0])  # whitened over the 4 valid tokens, 0 elsewhere
    expected = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    assert torch.allclose(adv[0, [0, 1, 4, 5]], expected, atol=1e-6) and adv[0, 2:4].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="gamma"):
        rpp(rewards, mask, config={})


def test_remax_at_masked_positions_matches_upstream():
    from verl.trainer.ppo.core_algos import compute_remax_outcome_advantage

    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])  # a hole at 1, padding at 4
    adv, returns = compute_remax_outcome_advantage(rewards, torch.tensor([0.25]), mask, config=None)
    assert returns.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0]]
    assert adv.tolist() == [[0.75, 1.0, 0.75, 0.75, 0.0]]  # returns - baseline * mask


def test_estimators_accept_upstream_config_and_index_keywords():
    from verl.trainer.ppo import core_algos

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    index = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, index=index, epsilon=1e-6, norm_adv_by_std_in_grpo=False,
        config={"gamma": 1.0},
    )  # fmt: skip
    assert adv[:, 0].tolist() == [0.5, -0.5, 0.5, -0.5]
    adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, index, 1e-6, {"gamma": 1.0})
    assert adv[:, 0].tolist() == [1.0, -1.0, 1.0, -1.0]


def test_policy_loss_upstream_vanilla_form():
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import compute_policy_loss, compute_policy_loss_vanilla, get_policy_loss_fn

    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.3, clip_ratio_c=3.0)
    # token 0: A=1, ratio 1.5 clipped to 1.3 -> -1.3; token 1: A=-1, ratio 0.5 clipped to 0.8 -> max(0.5, 0.8) = 0.8
    loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg)
    assert float(loss) == pytest.approx((-1.3 + 0.8) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)
    assert get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", cfg)[0] == pytest.approx(float(loss))
    ours = compute_policy_loss(old, new, adv, mask, cliprange=0.2, cliprange_high=0.3)
    assert len(ours) == 4 and float(ours[0]) == pytest.approx(float(loss))
    weighted, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, config=cfg, rollout_is_weights=torch.tensor([[2.0, 0.0]])
    )
    assert float(weighted) == pytest.approx(-1.3 * 2 / 2)


def test_policy_loss_upstream_vanilla_form_reads_clip_ratio_c_from_the_config():
    """The dual-clip bound comes from the actor config's ``clip_ratio_c`` (3.0 only when it is unset)."""
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    old, new = torch.zeros(1, 1), torch.log(torch.tensor([[5.0]]))  # ratio 5
    adv, mask = torch.tensor([[-2.0]]), torch.ones(1, 1)
    # A = -2, ratio 5: PPO-clipped loss max(10, 2.4) = 10; dual clip min(10, -A * c)
    for c, expected in ((2.0, 4.0), (4.0, 8.0), (None, 6.0)):
        cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=c)
        loss, metrics = compute_policy_loss_vanilla(old, new, adv, mask, "token-mean", cfg)
        assert float(loss) == pytest.approx(expected), c
        assert metrics["actor/pg_clipfrac_lower"] == 1.0


# ------------------------------------------------------------------ utils


def test_masked_mean_ignores_nan_at_masked_positions():
    from verl.utils import torch_functional as verl_F

    values = torch.tensor([1.0, float("nan"), 4.0])
    mask = torch.tensor([1, 0, 1])
    assert float(verl_F.masked_mean(values, mask)) == 2.5
    assert float(verl_F.masked_sum(values, mask)) == 5.0
    assert float(verl_F.masked_var(values, mask)) == pytest.approx(4.5)
    rows = torch.tensor([[1.0, float("inf")], [2.0, 4.0]])
    assert verl_F.masked_mean(rows, torch.tensor([[1, 0], [1, 1]]), axis=-1).tolist() == [1.0, 3.0]


def test_torch_functional_named_helpers():
    from verl.utils import torch_functional as verl_F

    assert verl_F.get_response_mask(torch.tensor([[5, 2, 7, 2], [1, 1, 1, 1]]), eos_token=2).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 1],
    ]
    assert verl_F.get_eos_mask(torch.tensor([[3, 4, 5]]), eos_token=[4, 5]).tolist() == [[1, 1, 0]]
    assert verl_F.pad_2d_list_to_length([[1], [2, 3]], 0, max_length=3).tolist() == [[1, 0, 0], [2, 3, 0]]
    assert verl_F.pad_sequence_to_length(torch.tensor([[1, 2]]), 4, 9, left_pad=True).tolist() == [[9, 9, 1, 2]]
    assert verl_F.clip_by_value(torch.tensor([0.0, 5.0]), torch.tensor(1.0), torch.tensor(2.0)).tolist() == [1.0, 2.0]
    logits = torch.tensor([[[0.0, 0.0]], [[0.0, 1.0]]])
    labels = torch.tensor([[0], [1]])
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(verl_F.logprobs_from_logits_v2(logits, labels), expected)
    assert torch.allclose(verl_F.logprobs_from_logits_naive(logits, labels), expected)
    assert verl_F.entropy_from_logits_with_chunking(torch.zeros(3, 4), chunk_size=2).tolist() == pytest.approx(
        [np.log(4)] * 3
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = verl_F.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6, min_lr_ratio=0.1)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warm-up 0, 0.5; then 0.1 + 0.9 * (1 + cos(pi * p)) / 2 for p = 0, 1/4, 1/2, 3/4, 1
    cos = [0.1 + 0.9 * (1 + np.cos(np.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75, 1.0)]
    assert lrs == pytest.approx([0.0, 0.5] + cos)


def test_seqlen_balancing_karmarkar_karp_beats_greedy():
    from verl.utils.seqlen_balancing import (
        ceildiv,
        get_seqlen_balanced_partitions,
        greedy_partition,
        karmarkar_karp,
        log_seqlen_unbalance,
        prepare_dynamic_batch,
        rearrange_micro_batches,
        restore_dynamic_batch,
        roundup_divisible,
    )

    lengths = [8, 7, 6, 5, 4]
    # KK by hand: 8|7 -> spread 1, 6|5 -> 1; 4 joins the 8|7 state -> {4, 7}=11 | {8}=8; that with 6|5 ->
    # {4, 7, 5}=16 | {8, 6}=14 (spread 2). Greedy longest-first: {8, 5, 4}=17 | {7, 6}=13 (spread 4).
    assert karmarkar_karp(lengths, 2, False) == [[4, 1, 3], [0, 2]]
    assert get_seqlen_balanced_partitions(lengths, 2, False) == [[1, 3, 4], [0, 2]]
    assert greedy_partition(lengths, 2, False) == [[0, 3, 4], [1, 2]]
    equal = get_seqlen_balanced_partitions([1, 2, 3, 4, 5, 6], k_partitions=2, equal_size=True)
    assert sorted(len(p) for p in equal) == [3, 3] and sorted(sum(p) + len(p) for p in equal) == [10, 11]
    assert ceildiv(7, 2) == 4 and roundup_divisible(5, 4) == 8
    stats = log_seqlen_unbalance(lengths, [[1, 3, 4], [0, 2]], "seqlen")
    assert stats["seqlen/balanced_max"] == 16 and stats["seqlen/balanced_min"] == 14

    # upstream form: a TensorDict with attention_mask -> (micro TensorDicts, indices)
    mask = torch.zeros(5, 8, dtype=torch.long)
    for row, length in enumerate([5, 1, 4, 2, 7]):
        mask[row, :length] = 1
    batch = TensorDict({"attention_mask": mask, "row": torch.arange(5)}, batch_size=[5])
    micro, indices = rearrange_micro_batches(batch, max_token_len=8)
    assert indices == [[0, 1], [2, 3], [4]] and [m["row"].tolist() for m in micro] == indices
    _, divided = rearrange_micro_batches(batch, 8, None, 2)  # num_batches_divided_by=2 -> 4 micro-batches
    assert len(divided) == 4
    data = _proto(5)
    data.batch["attention_mask"] = mask
    parts, idx = prepare_dynamic_batch(data, max_token_len=8)
    assert [p.non_tensor_batch["uid"].tolist() for p in parts] == [[f"u{i}" for i in rows] for rows in idx]
    out = torch.cat([p.batch["obs"] for p in parts])
    assert torch.equal(restore_dynamic_batch(out, idx), data.batch["obs"])


def test_metric_reduction_and_metric_utils_names():
    from verl.trainer.ppo import metric_utils
    from verl.utils.metric import reduce_metrics, weighted_mean

    reduced = reduce_metrics({"loss": [1.0, 2.0, 3.0], "response_length/max": [5, 8], "lr/min": [3, 1]})
    assert reduced == {"loss": 2.0, "response_length/max": 8.0, "lr/min": 1.0}
    assert metric_utils.reduce_metrics is reduce_metrics
    assert weighted_mean([0.8, 0.6], [100, 200]) == pytest.approx(2.0 / 3.0)
    data = [{"pred": "a", "acc": 1.0}, {"pred": "b", "acc": 0.0}, {"pred": "b", "acc": 0.5}]
    assert metric_utils.calc_maj_val(data, vote_key="pred", val_key="acc") == 0.0
    (mean, std), = metric_utils.bootstrap_metric([1.0, 1.0, 1.0], 2, [np.mean], n_bootstrap=5)  # fmt: skip
    assert (mean, std) == (1.0, 0.0)


def test_reward_score_upstream_routes_and_numbers():
    from verl.utils.reward_score import default_compute_score, gsm8k
    from verl.utils.reward_score import math as math_reward

    assert gsm8k.compute_score("so #### 42.", "42") == 0.0  # strict default; the period is part of the answer
    assert gsm8k.compute_score("so #### 42", "42") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert math_reward.is_equiv("0.5", "\\frac{1}{2}") and math_reward.is_equiv("\\frac12", "\\frac{1}{2}")
    assert math_reward.is_equiv("\\dfrac{3}{4}", "3/4") and math_reward.is_equiv("x = 5", "5")
    assert not math_reward.is_equiv("0.25", "\\frac{1}{4}")  # only 0.5 is rewritten, as upstream
    assert math_reward.is_equiv("10\\text{ cm}", "10") and math_reward.is_equiv("\\sqrt3", "\\sqrt{3}")
    assert default_compute_score("lighteval/MATH", "so \\boxed{\\frac12}", "0.5") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", "no box 0.5", "0.5") == 0.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\fbox{1}", "1") == 0.0  # upstream asserts
