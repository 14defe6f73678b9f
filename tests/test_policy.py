"""Policies: validation messages, presets, per-layer overrides."""

from __future__ import annotations

import pytest

from kvtier import PRESETS, TierPolicy, get_policy


@pytest.mark.parametrize(
    "field,value,shown",
    [
        ("warm_bits", 5, "5"),
        ("hot_tokens", -1, "-1"),
        ("warm_tokens", 100, "100"),  # not a multiple of block_tokens
        ("cold", "zip", "'zip'"),
        ("block_tokens", 0, "0"),
        ("sink_tokens", 1.5, "1.5"),
        ("exact_dtype", "int8", "'int8'"),
        ("cold_bits", 1, "1"),
        ("layer_overrides", {0: "nope"}, "'nope'"),
    ],
)
def test_invalid_values_name_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as err:
        TierPolicy(**{field: value})
    msg = str(err.value)
    assert msg.startswith(field) and f"={shown} is not allowed" in msg and "expected" in msg


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_valid(name):
    p = get_policy(name)
    assert p.name == name
    assert PRESETS[name][0]  # documented


@pytest.mark.parametrize(
    "field,value,shown",
    [("level", 0.0, "0.0"), ("method", "topk", "'topk'"), ("max_query_tokens", 0, "0"), ("local_window", -1, "-1")],
)
def test_invalid_sparse_values_name_field_and_value(field, value, shown):
    from kvtier.policy import SparsePolicy

    with pytest.raises(ValueError) as err:
        SparsePolicy(**{field: value})
    msg = str(err.value)
    assert msg.startswith(field) and f"={shown} is not allowed" in msg and "expected" in msg


def test_unknown_preset():
    with pytest.raises(ValueError, match="policy='fast'"):
        get_policy("fast")


def test_layer_overrides_resolve_negative_indices():
    p = TierPolicy(warm_bits=2, layer_overrides={0: "exact", -1: TierPolicy(warm_bits=8)})
    assert p.for_layer(0, 10).is_exact
    assert p.for_layer(9, 10).warm_bits == 8
    assert p.for_layer(5, 10).warm_bits == 2
    assert p.for_layer(5, 10).layer_overrides == {}
