"""Upstream verl 0.9 call forms for the modules we share (issue 19): imports, positional and keyword
signatures, and the numbers they give on small hand-computed inputs. docs/differences.md lists what
still differs, with reasons."""

from __future__ import annotations

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
