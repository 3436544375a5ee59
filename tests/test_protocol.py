"""Tests for verl.protocol.DataProto: small batches whose expected contents are written out by hand."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto


def make_batch(num_rows: int = 4) -> DataProto:
    """Row i has ids [10i, 10i+1, 10i+2], response_mask [1, 1, 0], uid 'u{i}' and a list payload."""
    ids = torch.tensor([[10 * i, 10 * i + 1, 10 * i + 2] for i in range(num_rows)])
    return DataProto.from_single_dict(
        {
            "input_ids": ids,
            "response_mask": torch.tensor([[1, 1, 0]] * num_rows),
            "uid": [f"u{i}" for i in range(num_rows)],
            "payload": [[i, i] for i in range(num_rows)],
        },
        meta_info={"temperature": 1.0},
    )


def row_ids(data: DataProto) -> list[int]:
    """The row number encoded in input_ids[:, 0] (= 10 * original row)."""
    return (data.batch["input_ids"][:, 0] // 10).tolist()


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert a.meta_info == b.meta_info


# ------------------------------------------------------------------ construction / consistency


def test_from_single_dict_splits_tensors_and_non_tensors():
    data = make_batch(4)
    assert len(data) == 4
    assert isinstance(data.batch, TensorDict) and list(data.batch.batch_size) == [4]
    assert sorted(data.batch.keys()) == ["input_ids", "response_mask"]
    assert sorted(data.non_tensor_batch) == ["payload", "uid"]
    payload = data.non_tensor_batch["payload"]
    # equal-length lists stay a 1-D object array of lists, not a (4, 2) array
    assert payload.dtype == object and payload.shape == (4,)
    assert payload[2] == [2, 2]
    assert data.meta_info == {"temperature": 1.0}


def test_from_dict_non_tensors_only_and_numpy_kept():
    data = DataProto.from_dict(non_tensors={"score": np.array([0.5, 1.0]), "tag": ["a", "b"]})
    assert data.batch is None and len(data) == 2
    assert data.non_tensor_batch["score"].dtype == np.float64
    assert DataProto().__len__() == 0


def test_tensor_row_mismatch_names_keys_and_lengths():
    with pytest.raises(ValueError) as err:
        DataProto.from_dict({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)})
    msg = str(err.value)
    assert "'b'" in msg and "3 rows" in msg and "'a'" in msg and "4 rows" in msg


def test_non_tensor_row_mismatch_names_key_and_lengths():
    with pytest.raises(ValueError) as err:
        DataProto.from_dict({"a": torch.zeros(4)}, {"uid": ["x", "y", "z"]})
    assert str(err.value) == "non_tensor_batch['uid'] has 3 rows but batch has 4 rows"


def test_check_consistency_after_mutation():
    data = make_batch(4)
    data.non_tensor_batch["uid"] = data.non_tensor_batch["uid"][:2]
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has 2 rows but batch has 4 rows"):
        data.check_consistency()


def test_unsupported_value_type_is_named():
    with pytest.raises(TypeError, match="'n'"):
        DataProto.from_single_dict({"a": torch.zeros(2), "n": 3})


def test_repr_lists_keys_shapes_dtypes_and_length():
    text = repr(make_batch(4))
    assert text.startswith("DataProto(len=4,")
    assert "input_ids: int64[4, 3]" in text and "uid: object[4]" in text and "temperature" in text
    assert "\n" not in text


# ------------------------------------------------------------------ indexing


def test_int_index_returns_item():
    item = make_batch(4)[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["input_ids"].tolist() == [20, 21, 22]
    assert item.non_tensor_batch == {"uid": "u2", "payload": [2, 2]}
    assert item.meta_info == {"temperature": 1.0}
    assert make_batch(4)[-1].non_tensor_batch["uid"] == "u3"
    with pytest.raises(IndexError, match="4 rows"):
        make_batch(4)[4]


def test_slice_index_array_and_masks():
    data = make_batch(5)
    assert row_ids(data[1:4]) == [1, 2, 3]
    assert data[1:4].non_tensor_batch["uid"].tolist() == ["u1", "u2", "u3"]
    assert row_ids(data[[4, 0, 4]]) == [4, 0, 4]
    assert data[np.array([3, 1])].non_tensor_batch["uid"].tolist() == ["u3", "u1"]
    assert row_ids(data[torch.tensor([2, -1])]) == [2, 4]
    mask = [True, False, True, False, True]
    for m in (np.array(mask), torch.tensor(mask)):
        picked = data[m]
        assert row_ids(picked) == [0, 2, 4]
        assert picked.non_tensor_batch["uid"].tolist() == ["u0", "u2", "u4"]
    assert len(data[[]]) == 0 and len(data[np.zeros(5, dtype=bool)]) == 0
    with pytest.raises(IndexError, match="3 entries but DataProto has 5 rows"):
        data[np.array([True, False, True])]
    with pytest.raises(IndexError, match="row index 7"):
        data[[0, 7]]


# ------------------------------------------------------------------ select / pop / rename


def test_select_keeps_requested_keys_and_source():
    data = make_batch(3)
    sub = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(sub.batch.keys()) == ["input_ids"] and list(sub.non_tensor_batch) == ["uid"]
    assert sub.meta_info == {} and len(sub) == 3
    assert sorted(data.batch.keys()) == ["input_ids", "response_mask"]  # source untouched
    shared = data.select(batch_keys=["input_ids"])
    shared.batch["input_ids"][0, 0] = -1
    assert data.batch["input_ids"][0, 0] == -1  # shallow by default
    copied = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=["payload"], deepcopy=True)
    copied.batch["input_ids"][1, 0] = -5
    copied.non_tensor_batch["payload"][1].append(9)
    assert data.batch["input_ids"][1, 0] == 10 and data.non_tensor_batch["payload"][1] == [1, 1]


def test_select_missing_key_error_names_key_and_available():
    with pytest.raises(KeyError) as err:
        make_batch(3).select(batch_keys=["input_ids", "attention_mask"])
    msg = str(err.value)
    assert "'attention_mask'" in msg and "input_ids" in msg and "response_mask" in msg
    with pytest.raises(KeyError, match="'nope'.*payload.*uid"):
        make_batch(3).select(non_tensor_batch_keys=["nope"])


def test_pop_removes_from_source_and_returns_popped():
    data = make_batch(3)
    popped = data.pop(batch_keys=["input_ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["input_ids"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"temperature": 1.0} and row_ids(popped) == [0, 1, 2]
    assert list(data.batch.keys()) == ["response_mask"] and list(data.non_tensor_batch) == ["payload"]
    assert data.meta_info == {}
    only_non_tensor = data.pop(non_tensor_batch_keys=["payload"])
    assert len(only_non_tensor) == 3  # keeps the row count with no tensors


def test_pop_missing_key_leaves_source_unchanged():
    data = make_batch(3)
    with pytest.raises(KeyError, match="'missing'"):
        data.pop(batch_keys=["input_ids", "missing"])
    assert sorted(data.batch.keys()) == ["input_ids", "response_mask"]


def test_rename():
    data = make_batch(2).rename("input_ids", "ids")
    assert sorted(data.batch.keys()) == ["ids", "response_mask"]
    data.rename(["uid"], ["group"])
    assert data.non_tensor_batch["group"].tolist() == ["u0", "u1"]
    with pytest.raises(KeyError, match="'absent'"):
        data.rename("absent", "x")


# ------------------------------------------------------------------ union / concat


def test_union_merges_and_detects_conflicts():
    data = make_batch(3)
    extra = DataProto.from_dict(
        {"input_ids": data.batch["input_ids"].clone(), "scores": torch.tensor([1.0, 2.0, 3.0])},
        {"uid": ["u0", "u1", "u2"], "source": ["a", "b", "c"]},
        {"temperature": 1.0, "step": 7},
    )
    merged = data.union(extra)
    assert merged is data
    assert merged.batch["scores"].tolist() == [1.0, 2.0, 3.0]
    assert merged.non_tensor_batch["source"].tolist() == ["a", "b", "c"]
    assert merged.meta_info == {"temperature": 1.0, "step": 7}

    bad_tensor = DataProto.from_dict({"input_ids": torch.zeros(3, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]"):
        make_batch(3).union(bad_tensor)
    bad_uid = DataProto.from_dict(non_tensors={"uid": ["u0", "u1", "XX"]})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\]"):
        make_batch(3).union(bad_uid)
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\]"):
        make_batch(3).union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="3 rows.*2 rows"):
        make_batch(3).union(make_batch(2))


def test_concat_preserves_order_and_merges_meta():
    first, second = make_batch(4)[0:2], make_batch(4)[2:4]
    second.meta_info = {"temperature": 1.0, "extra": 1}
    joined = DataProto.concat([first, second])
    assert row_ids(joined) == [0, 1, 2, 3]
    assert joined.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert joined.non_tensor_batch["payload"].shape == (4,)
    assert joined.meta_info == {"temperature": 1.0, "extra": 1}


def test_concat_conflicting_meta_raises_and_metrics_merge():
    """verl's rule: a key held by several parts must agree; ``metrics`` dicts/lists become a dict of lists."""
    first, second = make_batch(4)[0:2], make_batch(4)[2:4]
    second.meta_info = {"temperature": 0.0}
    with pytest.raises(ValueError, match="meta_info key 'temperature'"):
        DataProto.concat([first, second])
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'temperature'"):
        DataProto.concat([first, second])
    first.meta_info = {"temperature": 1.0, "metrics": {"loss": 1.0}}
    second.meta_info = {"temperature": 1.0, "metrics": [{"loss": 2.0}, {"loss": 3.0}]}
    joined = DataProto.concat([first, second])
    assert joined.meta_info == {"temperature": 1.0, "metrics": {"loss": [1.0, 2.0, 3.0]}}


def test_concat_width_mismatch_names_key_and_shapes():
    narrow = DataProto.from_dict({"responses": torch.zeros(2, 5)})
    wide = DataProto.from_dict({"responses": torch.zeros(3, 7)})
    with pytest.raises(ValueError) as err:
        DataProto.concat([narrow, wide])
    msg = str(err.value)
    assert "'responses'" in msg and "(2, 5)" in msg and "(3, 7)" in msg


def test_concat_key_mismatch():
    with pytest.raises(ValueError, match="non_tensor_batch keys"):
        DataProto.concat([make_batch(2), make_batch(2).select(non_tensor_batch_keys=["uid"])])


# ------------------------------------------------------------------ chunk / split / repeat / reorder


def test_chunk_uneven_sizes_and_round_trip():
    data = make_batch(7)
    parts = data.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert [row_ids(p) for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert_same(DataProto.concat(parts), data)
    assert [len(p) for p in make_batch(2).chunk(4)] == [1, 1, 0, 0]


def test_split_by_int_and_by_list():
    data = make_batch(7)
    assert [len(p) for p in data.split(3)] == [3, 3, 1]
    parts = data.split([1, 4, 2])
    assert [row_ids(p) for p in parts] == [[0], [1, 2, 3, 4], [5, 6]]
    assert parts[2].non_tensor_batch["uid"].tolist() == ["u5", "u6"]
    with pytest.raises(ValueError, match=r"sum to 6 but DataProto has 7 rows"):
        data.split([3, 3])


def test_repeat_interleave_and_tile():
    data = make_batch(3)
    inter = data.repeat(repeat_times=2, interleave=True)
    assert row_ids(inter) == [0, 0, 1, 1, 2, 2]
    assert inter.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    tiled = data.repeat(repeat_times=2, interleave=False)
    assert row_ids(tiled) == [0, 1, 2, 0, 1, 2]
    assert tiled.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2"]
    assert tiled.non_tensor_batch["payload"].shape == (6,)


def test_reorder_in_place():
    data = make_batch(4)
    data.reorder(torch.tensor([2, 0, 3, 1]))
    assert row_ids(data) == [2, 0, 3, 1]
    assert data.non_tensor_batch["uid"].tolist() == ["u2", "u0", "u3", "u1"]
    with pytest.raises(ValueError, match="permutation"):
        data.reorder([0, 0, 1, 2])


def test_clone_is_independent():
    data = make_batch(2)
    twin = data.clone()
    twin.batch["input_ids"][0, 0] = 99
    twin.non_tensor_batch["payload"][0].append(5)
    twin.meta_info["temperature"] = 0.0
    assert data.batch["input_ids"][0, 0] == 0 and data.non_tensor_batch["payload"][0] == [0, 0]
    assert data.meta_info["temperature"] == 1.0
    assert data.to("cpu") is data


# ------------------------------------------------------------------ padding


def test_pad_to_divisor_then_unpad():
    data = make_batch(5)
    padded, pad_size = pad_dataproto_to_divisor(data, 4)
    assert pad_size == 3 and len(padded) == 8
    assert row_ids(padded) == [0, 1, 2, 3, 4, 0, 1, 2]  # copies cycled from the start
    assert padded.non_tensor_batch["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    assert padded.batch["is_padding"].tolist() == [False] * 5 + [True] * 3
    assert padded.batch["response_mask"][:5].tolist() == [[1, 1, 0]] * 5
    assert padded.batch["response_mask"][5:].tolist() == [[0, 0, 0]] * 3
    assert data.batch["response_mask"].sum() == 10  # input untouched
    assert_same(unpad_dataproto(padded, pad_size), data)


def test_pad_keeps_attention_mask_and_handles_more_padding_than_rows():
    data = DataProto.from_dict({"attention_mask": torch.tensor([[1, 1], [0, 1]])}, {"uid": ["a", "b"]})
    padded, pad_size = pad_dataproto_to_divisor(data, 5)
    assert pad_size == 3
    assert padded.batch["attention_mask"].tolist() == [[1, 1], [0, 1], [1, 1], [0, 1], [1, 1]]
    assert padded.non_tensor_batch["uid"].tolist() == ["a", "b", "a", "b", "a"]


def test_unpad_keeps_the_padding_flag_of_padding_that_remains_and_checks_the_size():
    """Padded twice, unpadded once: the first padding's rows are still there, and so is their flag."""
    data = make_batch(3)
    once, first = pad_dataproto_to_divisor(data, 4)
    twice, second = pad_dataproto_to_divisor(once, 3)
    assert (first, second) == (1, 2)
    back = unpad_dataproto(twice, second)
    assert back.batch["is_padding"].tolist() == [False, False, False, True]
    assert "is_padding" not in unpad_dataproto(back, first).batch.keys()
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 4\] for a DataProto with 4 rows, got 5"):
        unpad_dataproto(back, 5)


def test_pad_size_zero_returns_input_unchanged():
    data = make_batch(4)
    padded, pad_size = pad_dataproto_to_divisor(data, 2)
    assert padded is data and pad_size == 0 and "is_padding" not in data.batch.keys()
    assert unpad_dataproto(data, 0) is data


# ------------------------------------------------------------------ pickling / disk / Ray


def test_pickle_round_trip():
    data = make_batch(3)
    assert_same(pickle.loads(pickle.dumps(data)), data)


def test_save_and_load_from_disk(tmp_path):
    data = make_batch(3)
    path = tmp_path / "batch.pkl"
    data.save_to_disk(str(path))
    assert_same(DataProto.load_from_disk(str(path)), data)


def test_ray_round_trip(ray_cluster):
    import ray

    @ray.remote
    def double_ids(data: DataProto) -> DataProto:
        data.batch["input_ids"] = data.batch["input_ids"] * 2
        data.meta_info["seen"] = True
        return data

    data = make_batch(3)
    assert_same(ray.get(ray.put(data)), data)
    doubled = ray.get(double_ids.remote(data))
    assert doubled.batch["input_ids"].tolist() == [[0, 2, 4], [20, 22, 24], [40, 42, 44]]
    assert doubled.non_tensor_batch["payload"].tolist() == [[0, 0], [1, 1], [2, 2]]
    assert doubled.meta_info == {"temperature": 1.0, "seen": True}
    assert data.batch["input_ids"][1].tolist() == [10, 11, 12]  # caller's copy untouched

    @ray.remote(num_cpus=0)
    class Incrementer:
        def step(self, data: DataProto) -> DataProto:
            data.batch["input_ids"] += 1  # in-place write on the received tensor
            return data

    stepped = ray.get(Incrementer.remote().step.remote(data))
    assert stepped.batch["input_ids"][:, 0].tolist() == [1, 11, 21]
    assert stepped.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
