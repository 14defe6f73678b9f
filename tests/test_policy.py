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


# --- variant names: numbers in ASCII digits, vq only where there is a quantized cold tier ------------

LONG = "9" * 5000


@pytest.mark.parametrize(
    "name",
    [
        "default:vq³/3",
        "default:vq3/³",
        "adaptive@２.５",
        "adaptive@2.5:sinks=٣",
        "adaptive@2.5:fit_tokens=1_000",
        "adaptive@inf",
        "default:vq" + LONG,
        "adaptive@" + LONG,
        "adaptive@2.5:warmup_tokens=" + LONG,
    ],
)
def test_variant_numbers_outside_ascii_digits_get_the_variants_own_one_line_message(name):
    """``int()``/``float()`` took other scripts' digits (``adaptive@２.５`` was 2.5) or raised their own
    messages (``invalid literal for int()``, ``Exceeds the limit (4300 digits)``), in the API,
    ``kvtier plan`` and ``layer_overrides`` alike."""
    for make, start in ((get_policy, ""), (lambda n: TierPolicy(layer_overrides={1: n}), "layer_overrides[1]: ")):
        with pytest.raises(ValueError) as err:
            make(name)
        msg = str(err.value)
        assert msg.startswith(start + repr(name[:20])[:-1]) and "is not allowed: expected" in msg, msg[:300]
        assert "ASCII digits" in msg and "\n" not in msg and len(msg) < 500


def test_plan_refuses_a_variant_with_unicode_digits_in_one_line(capsys):
    from kvtier.cli import main

    assert main(["plan", "--model", "smollm2-135m", "--seq-len", "8", "--policy", "default:vq³/3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("kvtier plan: 'default:vq³/3' is not allowed: expected <preset>:vq")


@pytest.mark.parametrize(
    "name", ["chat:vq3/3", "code:vq2", "fp8:vq3", "kivi2:vq3", "sink-window:vq2", "offload-cpu:vq3", "exact:vq3"]
)
def test_vq_variant_of_a_preset_without_a_quantized_cold_tier_is_refused(name):
    """``chat:vq3/3`` and ``code:vq2`` were accepted and did nothing (no cold tier); the others were
    refused naming internal fields (``cold_codes='vq' ... unless cold='quant'``)."""
    base = name.partition(":")[0]
    with pytest.raises(ValueError) as err:
        get_policy(name)
    msg = str(err.value)
    assert msg == (
        f"{name!r} is not allowed: preset {base!r} has no quantized cold tier to code in vq; "
        "vq variants take default or max-compression, e.g. default:vq3/2"
    )


def test_vq_variant_replaces_a_quantized_cold_tier():
    p = get_policy("max-compression:vq2/1")  # its 1-bit sign tier becomes vector codes
    assert (p.cold, p.cold_codes, p.cold_bits, p.cold_value_bits, p.sparse) == ("quant", "vq", 2, 1, None)
    q = get_policy("default:vq3")
    assert (q.cold, q.cold_codes, q.cold_bits, q.cold_value_bits) == ("quant", "vq", 3, None)


# --- layer overrides against a model's layer count ---------------------------------------------------


def test_two_layer_override_keys_naming_one_layer_are_refused():
    """``{3: ..., -1: ...}`` on a 4-layer model: the last key silently won."""
    from kvtier.sizing import ModelShape, estimate

    p = TierPolicy(layer_overrides={3: "exact", -1: "kivi2"})
    msg = "layer_overrides keys 3 and -1 are not allowed together: both name layer 3 of 4 with different policies"
    with pytest.raises(ValueError, match=f"^{msg}; give one$"):
        p.check_layers(4)
    with pytest.raises(ValueError, match=msg):
        p.for_layer(0, 4)
    with pytest.raises(ValueError, match=msg):
        estimate(ModelShape("four", ("full_attention",) * 4, 2, 16), 8, p)
    p.check_layers(5)  # layers 3 and 4: two layers
    assert p.for_layer(3, 5).is_exact and p.for_layer(4, 5).name == "kivi2"
    TierPolicy(layer_overrides={0: "exact", -1: "exact"}).check_layers(1)  # one layer, one policy: no doubt
    hf = pytest.importorskip("kvtier.hf", reason="needs the transformers adapter (kvtier[hf])", exc_type=ImportError)
    from kvtier.testing import tiny_llama_config

    with pytest.raises(ValueError, match=msg):
        hf.TieredCache(tiny_llama_config(), p)  # 4 layers


def test_layer_override_key_beyond_the_model_is_refused_by_the_planner():
    """``for_layer`` (and so ``kvtier plan``) dropped a key past the model's layers silently."""
    from kvtier.sizing import ModelShape, estimate

    p = TierPolicy(layer_overrides={7: "exact"})
    with pytest.raises(ValueError, match="^layer_overrides key 7 is not allowed: the model has 4 layers$"):
        p.check_layers(4)
    with pytest.raises(ValueError, match="layer_overrides key 7 is not allowed: the model has 4 layers"):
        estimate(ModelShape("four", ("full_attention",) * 4, 2, 16), 8, p)
