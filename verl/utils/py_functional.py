"""Small dict helpers under upstream verl's names (``verl.utils.py_functional``)."""

from __future__ import annotations

from verl.protocol_values import values_equal

__all__ = ["union_two_dict", "append_to_dict"]


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Add the items of ``dict2`` to ``dict1`` (in place) and return it; a key in both must hold equal values
    (compared as ``DataProto`` compares meta_info: ``torch.equal``, NaN-aware arrays, ``==``), else ``ValueError``
    naming the key (upstream asserts)."""
    for key, value in dict2.items():
        if key in dict1 and not values_equal(dict1[key], value):
            raise ValueError(f"union_two_dict: '{key}' differs ({dict1[key]!r} vs {value!r})")
        dict1[key] = value
    return dict1


def append_to_dict(data: dict, new_data: dict) -> None:
    """Append each value of ``new_data`` to the list ``data[key]`` (created empty when missing), in place."""
    for key, value in new_data.items():
        data.setdefault(key, []).append(value)
