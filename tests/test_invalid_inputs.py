"""Invalid inputs, one table: every case names the error it must raise and what its one-line message
must show (the field and the bad value).

Three kinds of case: ``raises`` (a library call), ``cli`` (a ``kvtier`` command that must exit 2
with one line on stderr, no traceback) and ``usage`` (an argument argparse itself refuses: exit 2,
its usage text, then one error line). To add a case, append a row to ``CASES``; a callable gets the
test's ``tmp_path`` (for files it needs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvtier import OffloadPolicy, SparsePolicy, TierPolicy, get_policy
from kvtier.cli import main
from kvtier.eval.perplexity import stream_compare
from kvtier.eval.recall import build_case
from kvtier.sizing import ModelShape, estimate, model_shape


@dataclass(frozen=True)
class Case:
    """``run(tmp_path)`` raises ``error`` (kind ``"raises"``) or returns the argv of a command that
    must fail (kinds ``"cli"``, ``"usage"``); the message contains every string of ``shown``."""

    id: str
    kind: str
    run: Callable[[Path], object]
    error: type[BaseException] | None
    shown: tuple[str, ...]


def raises(id: str, fn: Callable[[Path], object], error: type[BaseException], *shown: str) -> Case:
    return Case(id, "raises", fn, error, shown)


def cli(id: str, argv: list[str] | Callable[[Path], list[str]], *shown: str) -> Case:
    return Case(id, "cli", argv if callable(argv) else (lambda _: argv), None, shown)


def usage(id: str, argv: list[str], *shown: str) -> Case:
    return Case(id, "usage", lambda _: argv, None, shown)


def policy(cls: type, **kwargs: object) -> Callable[[Path], object]:
    return lambda _: cls(**kwargs)


def config(**fields: object) -> Callable[[Path], str]:
    """Writes ``fields`` as ``config.json`` under the test's folder; returns its path."""

    def write(tmp: Path) -> str:
        path = tmp / "config.json"
        path.write_text(fields.pop("_raw") if "_raw" in fields else json.dumps(fields))
        return str(path)

    return write


GOOD_CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
NO_LAYERS = {k: v for k, v in GOOD_CONFIG.items() if k != "num_hidden_layers"}


def layer_calls(*states: tuple, policy: str = "default") -> Callable[[Path], object]:
    """A standalone tiered layer fed ``states`` in turn: each ``(k_shape, dtype, device)`` or a
    ``(k, v)`` pair of tensors; the last one must raise."""

    def run(_: Path) -> None:
        from kvtier.hf.layer import TieredLayer

        layer = TieredLayer(get_policy(policy))
        for st in states:
            if isinstance(st[0], torch.Tensor):
                k, v = st
            else:
                shape, dtype, device = st
                k = v = torch.zeros(shape, dtype=dtype, device=device)
            layer.update(k, v, kwargs={})

    return run


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip


def cache_call(**kwargs: object) -> Callable[[Path], object]:
    def run(_: Path) -> object:
        from kvtier import TieredCache

        return TieredCache(tiny_config(), **kwargs)

    return run


def cache_update(layer_idx: object) -> Callable[[Path], object]:
    def run(_: Path) -> object:
        from kvtier import TieredCache

        k = torch.zeros(1, 2, 3, 16)
        return TieredCache(tiny_config()).update(k, k, layer_idx, kwargs={})

    return run


F32, CPU = torch.float32, "cpu"


def bad_results(tmp: Path) -> str:
    path = tmp / "bad.json"
    path.write_text(json.dumps({"schema": "other"}))
    return str(path)


CASES = [
    # --- TierPolicy -------------------------------------------------------------------------
    raises("hot 4M", policy(TierPolicy, hot_tokens=4_000_000), ValueError, "hot_tokens=4000000", "1048576"),
    raises("hot 1e12", policy(TierPolicy, hot_tokens=10**12), ValueError, "hot_tokens=1000000000000", "1048576"),
    raises("hot negative", policy(TierPolicy, hot_tokens=-1), ValueError, "hot_tokens=-1"),
    raises("hot str", policy(TierPolicy, hot_tokens="128"), ValueError, "hot_tokens='128'"),
    raises("warm huge", policy(TierPolicy, warm_tokens=1 << 25), ValueError, "warm_tokens=33554432", "None"),
    raises("warm not multiple", policy(TierPolicy, warm_tokens=100), ValueError, "warm_tokens=100", "block_tokens"),
    raises("warm_bits 5", policy(TierPolicy, warm_bits=5), ValueError, "warm_bits=5", "(2, 3, 4, 6, 8, 'fp8')"),
    raises("warm_bits float", policy(TierPolicy, warm_bits=4.0), ValueError, "warm_bits=4.0"),
    raises("warm_bits bool", policy(TierPolicy, warm_bits=True), ValueError, "warm_bits=True"),
    raises("sink huge", policy(TierPolicy, sink_tokens=1 << 17), ValueError, "sink_tokens=131072", "65536"),
    raises("sink float", policy(TierPolicy, sink_tokens=1.5), ValueError, "sink_tokens=1.5"),
    raises("block 0", policy(TierPolicy, block_tokens=0), ValueError, "block_tokens=0"),
    raises("block huge", policy(TierPolicy, block_tokens=8192, warm_tokens=0), ValueError, "block_tokens=8192", "4096"),
    raises("group huge", policy(TierPolicy, value_group_size=2048), ValueError, "value_group_size=2048", "1024"),
    raises("group 0", policy(TierPolicy, value_group_size=0), ValueError, "value_group_size=0"),
    raises("cold mode", policy(TierPolicy, cold="zip"), ValueError, "cold='zip'", "'offload'"),
    raises("cold_bits", policy(TierPolicy, cold_bits=1), ValueError, "cold_bits=1"),
    raises("rotation int", policy(TierPolicy, cold_rotation=1), ValueError, "cold_rotation=1", "bool"),
    raises("exact dtype", policy(TierPolicy, exact_dtype="int8"), ValueError, "exact_dtype='int8'"),
    raises("sparse str", policy(TierPolicy, sparse="yes"), ValueError, "sparse='yes'", "SparsePolicy"),
    raises("override name", policy(TierPolicy, layer_overrides={0: "nope"}), ValueError, "layer_overrides[0]='nope'"),
    raises("override key", policy(TierPolicy, layer_overrides={"0": "exact"}), ValueError, "layer_overrides key='0'"),
    raises("overrides list", policy(TierPolicy, layer_overrides=[0]), ValueError, "layer_overrides=[0]"),
    raises("offload not cold", policy(TierPolicy, offload=OffloadPolicy()), ValueError, "offload=", "cold='offload'"),
    raises("offload+sparse", policy(TierPolicy, cold="offload", sparse=SparsePolicy()), ValueError, "sparse="),
    raises("empty name", policy(TierPolicy, name=""), ValueError, "name=''"),
    # --- SparsePolicy -----------------------------------------------------------------------
    raises("level 0", policy(SparsePolicy, level=0.0), ValueError, "level=0.0", "(0, 1]"),
    raises("level nan", policy(SparsePolicy, level=float("nan")), ValueError, "level=nan"),
    raises("level 1.5", policy(SparsePolicy, level=1.5), ValueError, "level=1.5"),
    raises("topk tokens", policy(SparsePolicy, method="topk"), ValueError, "method='topk'", "select='tokens'"),
    raises("select", policy(SparsePolicy, select="rows"), ValueError, "select='rows'"),
    raises("query 0", policy(SparsePolicy, max_query_tokens=0), ValueError, "max_query_tokens=0"),
    raises("window huge", policy(SparsePolicy, local_window=1 << 25), ValueError, "local_window=33554432"),
    raises("min_blocks -1", policy(SparsePolicy, min_blocks=-1), ValueError, "min_blocks=-1"),
    # --- OffloadPolicy ----------------------------------------------------------------------
    raises("backend", policy(OffloadPolicy, backend="gpu"), ValueError, "backend='gpu'", "'disk'"),
    raises("path on cpu", policy(OffloadPolicy, path="/tmp"), ValueError, "path='/tmp'", "backend='disk'"),
    raises("store_bits", policy(OffloadPolicy, store_bits=2), ValueError, "store_bits=2"),
    raises("mass 0", policy(OffloadPolicy, mass=0), ValueError, "mass=0"),
    raises("max_blocks 0", policy(OffloadPolicy, max_blocks=0), ValueError, "max_blocks=0"),
    raises("margin huge", policy(OffloadPolicy, margin=1 << 21), ValueError, "margin=2097152"),
    raises("prefetch str", policy(OffloadPolicy, prefetch="yes"), ValueError, "prefetch='yes'"),
    # --- preset names -----------------------------------------------------------------------
    raises("preset", lambda _: get_policy("fast"), ValueError, "policy='fast'", "'default'"),
    raises("preset list", lambda _: get_policy(["x"]), ValueError, "policy=['x']"),
    raises("preset None", lambda _: get_policy(None), ValueError, "policy=None"),
    raises("variant twice", lambda _: get_policy("adaptive@2.5:keep=0.5:keep=1"), ValueError, "'keep' is given twice"),
    raises("variant sinks twice", lambda _: get_policy("adaptive@2:sinks=4:sinks=8"), ValueError, "'sinks' is given"),
    raises("variant empty option", lambda _: get_policy("adaptive@2.5::keep=1"), ValueError, "adaptive@<bits>"),
    raises("variant trailing colon", lambda _: get_policy("adaptive@2.5:"), ValueError, "'adaptive@2.5:'"),
    raises("variant spaced bits", lambda _: get_policy("adaptive@ 2.5"), ValueError, "'adaptive@ 2.5'"),
    raises("adaptive widths", lambda _: get_policy("adaptive:vq3"), ValueError, "chooses its cold widths", "codes=vq"),
    # --- planner ----------------------------------------------------------------------------
    raises("model name", lambda _: model_shape("gpt-9"), ValueError, "'gpt-9'", "llama-2-13b"),
    raises("config lacks", lambda t: model_shape(config(**NO_LAYERS)(t)), ValueError, "lacks 'num_hidden_layers'"),
    raises("config no head", lambda t: model_shape(config(num_hidden_layers=2)(t)), ValueError, "config.json lacks"),
    raises("config not json", lambda t: model_shape(config(_raw="{nope")(t)), ValueError, "config.json", "JSON"),
    raises("config list", lambda t: model_shape(config(_raw="[1, 2]")(t)), ValueError, "config.json", "object"),
    raises(
        "config kv 0",
        lambda t: model_shape(config(**{**GOOD_CONFIG, "num_key_value_heads": 0})(t)),
        ValueError,
        "config.json",
        "num_key_value_heads=0",
    ),
    raises(
        "config layer_types",
        lambda t: model_shape(config(**{**GOOD_CONFIG, "layer_types": ["full_attention"]})(t)),
        ValueError,
        "layer_types=['full_attention']",
        "2 layer kinds",
    ),
    raises(
        "config fractional head_dim",
        lambda t: model_shape(config(**{**GOOD_CONFIG, "hidden_size": 100})(t)),
        ValueError,
        "hidden_size=100",
        "num_attention_heads=8",
    ),
    raises(
        "config heads vs kv",
        lambda t: model_shape(config(**{**GOOD_CONFIG, "num_attention_heads": 5, "head_dim": 32})(t)),
        ValueError,
        "num_attention_heads=5",
        "num_key_value_heads=2",
    ),
    raises("shape kv 0", lambda _: ModelShape("m", ["full_attention"], 0, 64), ValueError, "kv_heads=0"),
    raises("shape no layers", lambda _: ModelShape("m", [], 2, 64), ValueError, "layers=0"),
    raises("seq 0", lambda _: estimate("llama-2-7b", 0), ValueError, "seq_len=0"),
    raises("seq 1e13", lambda _: estimate("llama-2-7b", 10**13), ValueError, "seq_len=10000000000000", "16777216"),
    raises("batch 0", lambda _: estimate("llama-2-7b", 10, batch=0), ValueError, "batch=0"),
    raises("batch huge", lambda _: estimate("llama-2-7b", 10, batch=1 << 17), ValueError, "batch=131072"),
    raises(
        "tokens in all", lambda _: estimate("llama-2-7b", 1 << 24, batch=8), ValueError, "batch * seq_len", "67108864"
    ),
    raises("plan dtype", lambda _: estimate("llama-2-7b", 10, dtype=torch.int8), ValueError, "dtype=torch.int8"),
    raises("plan policy", lambda _: estimate("llama-2-7b", 10, "fast"), ValueError, "policy='fast'"),
    # --- evaluation inputs too short to measure anything --------------------------------------
    raises("window 2", lambda _: stream_compare(None, torch.zeros(1, 2, dtype=torch.long), []), ValueError, "2 tokens"),
    raises("recall case 16", lambda _: build_case(None, "text", 16, 0.5, 0), ValueError, "context_tokens=16", "64"),
    # --- CLI: one line on stderr, exit 2 ------------------------------------------------------
    cli("plan seq 1e13", ["plan", "--model", "llama-2-13b", "--seq-len", "10000000000000"], "seq_len=10000000000000"),
    cli("plan batch", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--batch", "100000"], "batch=100000"),
    cli("plan model", ["plan", "--model", "gpt-9", "--seq-len", "10"], "kvtier plan:", "'gpt-9'"),
    cli(
        "plan config lacks",
        lambda t: ["plan", "--model", config(**NO_LAYERS)(t), "--seq-len", "10"],
        "config.json lacks 'num_hidden_layers'",
    ),
    cli("eval missing text", ["eval", "ppl", "--text", "missing.txt"], "kvtier eval ppl:", "missing.txt"),
    cli("recall missing text", ["eval", "recall", "--text", "missing.txt"], "kvtier eval recall:", "missing.txt"),
    cli("bench missing text", ["bench", "--text", "missing.txt"], "kvtier bench:", "missing.txt"),
    cli("demo missing text", ["demo", "--text", "missing.txt"], "kvtier demo:", "missing.txt"),
    cli("demo baseline", ["demo", "--policy", "dynamic"], "kvtier demo:", "--policy dynamic", "preset variant"),
    cli("demo variant", ["demo", "--policy", "default:vqx"], "kvtier demo:", "'default:vqx'", "<preset>:vq"),
    cli("demo policy", ["demo", "--policy", "nope"], "kvtier demo:", "cache 'nope' is not allowed"),
    cli("plan variant", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--policy", "x:vq"], "policy='x:vq'"),
    cli("report missing", ["report", "missing.json"], "kvtier report:", "missing.json"),
    cli("report invalid", lambda t: ["report", bad_results(t), "-o", str(t / "r.md")], "bad.json", "results lack"),
    # --- CLI: argparse's own usage errors (exit 2) ---------------------------------------------
    usage("seq negative", ["plan", "--model", "llama-2-13b", "--seq-len", "-5"], "--seq-len", "'-5'"),
    usage("seq text", ["plan", "--model", "llama-2-13b", "--seq-len", "abc"], "--seq-len", "'abc'"),
    usage("dtype", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--dtype", "int8"], "--dtype", "int8"),
    usage("depth", ["demo", "--depth", "2"], "--depth", "'2'"),
    usage("contexts overflow", ["eval", "ppl", "--contexts", "1e400k"], "--contexts", "1e400k"),
    usage("depths", ["eval", "recall", "--depths", "0,1.5"], "--depths", "0,1.5"),
    usage("caches", ["eval", "ppl", "--caches", "fast"], "--caches", "fast"),
    usage("max-bytes", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--max-bytes", "9Q"], "--max-bytes", "9Q"),
    cli("doctor offload dir", ["doctor", "--offload-dir", "."], "kvtier doctor:", "--offload-dir"),
    # --- issue 33, item 8: inputs that parsed, then crashed or ran something else ----------------
    usage("threads 100000", ["eval", "ppl", "--threads", "100000"], "--threads", "[1, 1024]", "'100000'"),
    usage("threads 0", ["bench", "--threads", "0"], "--threads", "'0'"),
    usage("demo threads", ["demo", "--threads", "1025"], "--threads", "'1025'"),
    usage("doctor threads", ["doctor", "--threads", "100000"], "--threads", "'100000'"),
    cli("ppl contexts 1", ["eval", "ppl", "--contexts", "1"], "kvtier eval ppl:", "--contexts 1", "at least 3"),
    cli("fidelity contexts 2", ["eval", "fidelity", "--contexts", "2k,2"], "kvtier eval fidelity:", "--contexts 2"),
    cli("demo ppl-tokens 1", ["demo", "--ppl-tokens", "1"], "kvtier demo:", "--ppl-tokens 1", "at least 3"),
    cli("recall contexts 16", ["eval", "recall", "--contexts", "16"], "kvtier eval recall:", "--contexts 16", "64"),
    cli("demo tokens 1", ["demo", "--tokens", "1"], "kvtier demo:", "--tokens 1", "at least 64"),
    cli("doctor cuda:4096", ["doctor", "--device", "cuda:4096"], "kvtier doctor:", "--device 'cuda:4096'"),
    cli("doctor device tpu", ["doctor", "--device", "tpu"], "kvtier doctor:", "--device 'tpu'", "cpu, cuda"),
    *(
        []
        if torch.cuda.is_available()
        else [cli("doctor cuda", ["doctor", "--device", "cuda"], "kvtier doctor:", "CUDA is not available")]
    ),
    usage(
        "max-bytes 0.5", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--max-bytes", "0.5"], "'0.5'", "whole"
    ),
    usage("max-bytes 1.1K", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--max-bytes", "1.1K"], "'1.1K'"),
    usage("max-bytes nan", ["plan", "--model", "llama-2-13b", "--seq-len", "8", "--max-bytes", "nan"], "'nan'"),
    cli(
        "plan fractional head_dim",
        lambda t: ["plan", "--model", config(**{**GOOD_CONFIG, "hidden_size": 260})(t), "--seq-len", "10"],
        "kvtier plan:",
        "hidden_size=260",
        "num_attention_heads=8",
        "32.5",
    ),
    cli(
        "plan heads not multiple of kv",
        lambda t: ["plan", "--model", config(**{**GOOD_CONFIG, "num_key_value_heads": 3})(t), "--seq-len", "10"],
        "kvtier plan:",
        "num_attention_heads=8",
        "num_key_value_heads=3",
    ),
    # --- a cache and its calls: shapes, dtypes, devices, layers ---------------------------------
    raises("states 3d", layer_calls(((1, 2, 16), F32, CPU)), ValueError, "[batch, kv_heads, tokens, head_dim]"),
    raises(
        "k/v shapes differ",
        layer_calls((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 8))),
        ValueError,
        "(1, 2, 3, 16) and (1, 2, 3, 8)",
    ),
    raises("states int", layer_calls(((1, 2, 3, 16), torch.int64, CPU)), TypeError, "floating point", "torch.int64"),
    raises(
        "kv heads changed",
        layer_calls(((1, 2, 3, 16), F32, CPU), ((1, 4, 1, 16), F32, CPU)),
        ValueError,
        "holds 2 KV heads of dim 16",
        "gave 4 of dim 16",
    ),
    raises(
        "head dim changed",
        layer_calls(((1, 2, 3, 16), F32, CPU), ((1, 2, 1, 32), F32, CPU)),
        ValueError,
        "gave 2 of dim 32",
    ),
    raises(
        "batch changed", layer_calls(((1, 2, 3, 16), F32, CPU), ((3, 2, 1, 16), F32, CPU)), ValueError, "the call has 3"
    ),
    raises(
        "dtype changed",
        layer_calls(((1, 2, 3, 16), F32, CPU), ((1, 2, 1, 16), torch.bfloat16, CPU)),
        TypeError,
        "torch.float32 model",
        "torch.bfloat16",
    ),
    raises(
        "device changed",
        layer_calls(((1, 2, 3, 16), F32, CPU), ((1, 2, 1, 16), F32, "meta")),
        ValueError,
        "lives on cpu",
        "meta",
    ),
    raises("cache max_bytes 0", cache_call(max_bytes=0), ValueError, "max_bytes=0"),
    raises("cache max_bytes float", cache_call(max_bytes=1.5e9), ValueError, "max_bytes=1500000000.0"),
    raises("cache on_full", cache_call(max_bytes=1 << 20, on_full="drop"), ValueError, "on_full='drop'"),
    raises("cache attention path", cache_call(attention="flash"), ValueError, "attention='flash'"),
    raises("cache policy", cache_call(policy="fastest"), ValueError, "policy='fastest'"),
    raises("cache config", lambda _: __import__("kvtier").TieredCache("llama"), TypeError, "str"),
    raises("cache layer 99", cache_update(99), RuntimeError, "layer_idx=99", "built for 2 layers"),
    raises("enable non-model", lambda _: __import__("kvtier").enable(object()), TypeError, "object"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_input(case: Case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths ("missing.txt") resolve in an empty folder
    if case.kind == "raises":
        with pytest.raises(case.error) as err:
            case.run(tmp_path)
        message = str(err.value)
        assert "\n" not in message
    elif case.kind == "cli":
        assert main(case.run(tmp_path)) == 2
        out = capsys.readouterr()
        assert "Traceback" not in out.err and out.out == ""
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvtier ")
        message = lines[0]
    else:
        with pytest.raises(SystemExit) as exit_:
            main(case.run(tmp_path))
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("usage: kvtier")
        message = err.strip().splitlines()[-1]
        assert ": error: argument " in message
    for text in case.shown:
        assert text in message, (text, message)


def test_table_is_large_and_ids_unique():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
