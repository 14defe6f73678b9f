"""``kvtier serve``'s plan (argv, environment, kernels) and its refusals; no vLLM needed (the real
server is started by tests/vllm/test_vllm_serve.py)."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.vllm.serve import SERVER_MODULE, plan_serve


def _flag(argv, name: str) -> str:  # noqa: ANN001
    return argv[argv.index(name) + 1]


def test_pages_is_the_default_and_flags_go_on_to_vllm(tmp_path):
    plan = plan_serve(str(tmp_path), vllm_args=["--port", "8123", "--max-model-len", "4096"], environ={})
    argv = list(plan.argv)
    assert argv[1:3] == ["-m", SERVER_MODULE]
    assert _flag(argv, "--model") == str(tmp_path)
    assert json.loads(_flag(argv, "--additional-config"))["kvtier_attention"].startswith("KVTierAttention_b4")
    assert _flag(argv, "--block-size") == "128"
    assert argv[-4:] == ["--port", "8123", "--max-model-len", "4096"]  # after kvtier's own
    assert "--enforce-eager" in argv
    env = dict(plan.env)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "VLLM_CPU_KVCACHE_SPACE" in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # packed pages work under multiprocessing
    assert plan.kernels == ("vllm_paged_cpu", "prefill_cpu")


def test_store_runs_under_vllms_default_multiprocessing(tmp_path):
    plan = plan_serve(
        "some/model",
        store="chat",
        cpu_bytes=1 << 30,
        disk=str(tmp_path),
        disk_bytes=2 << 30,
        transfer_bytes=1 << 28,
        environ={},
    )
    extra = json.loads(_flag(list(plan.argv), "--kv-transfer-config"))["kv_connector_extra_config"]
    assert (extra["kvtier_policy"], extra["kvtier_cpu_bytes"]) == ("chat", 1 << 30)
    assert extra["kvtier_transfer_bytes"] == 1 << 28
    assert (extra["kvtier_disk_path"], extra["kvtier_disk_bytes"]) == (str(tmp_path), 2 << 30)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in dict(plan.env)  # the store crosses processes
    assert "--additional-config" not in plan.argv


def test_the_users_environment_wins(tmp_path):
    plan = plan_serve(str(tmp_path), environ={"VLLM_CPU_KVCACHE_SPACE": "40"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in dict(plan.env)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"disk": "/tmp/x"}, "add --store"),
        ({"transfer_bytes": 1 << 28}, "add --store"),
        ({"vllm_args": ["--block-size=16"]}, "--block-size is set by kvtier serve"),
        ({"store": "default", "vllm_args": ["--kv_transfer_config", "{}"]}, "--kv-transfer-config is set"),
        ({"pages": "no-such-policy"}, "no-such-policy"),
        ({"store": "no-such-policy"}, "no-such-policy"),
    ],
)
def test_conflicts_are_one_line_before_anything_starts(tmp_path, kwargs, message):
    kwargs.setdefault("environ", {})
    with pytest.raises((ValueError, KeyError), match=message):
        plan_serve(str(tmp_path), **kwargs)


def test_cli_dry_run_prints_the_command(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--store", "default", "--cpu-bytes", "1G", "--dry-run", "--port", "9"]) == 0
    err = capsys.readouterr().err
    assert "prefix store (default)" in err and SERVER_MODULE in err and err.rstrip().endswith("--port 9")


def test_cli_refuses_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--pages", "default", "--disk", "/tmp/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier serve: ") and "\n" not in err


def test_other_commands_still_refuse_unknown_flags():
    with pytest.raises(SystemExit) as exc:
        main(["models", "list", "--bogus"])
    assert exc.value.code == 2


def test_a_built_in_model_is_served_under_its_name(monkeypatch):
    import kvtier.models

    monkeypatch.setattr(kvtier.models, "model_dir", lambda name: f"/cache/{name}-converted")
    argv = list(plan_serve("smollm2-135m", environ={}).argv)
    assert _flag(argv, "--model") == "/cache/smollm2-135m-converted"
    assert _flag(argv, "--served-model-name") == "smollm2-135m"
    argv = list(plan_serve("smollm2-135m", environ={}, vllm_args=["--served-model-name", "x"]).argv)
    assert argv.count("--served-model-name") == 1


def test_pages_and_store_together(tmp_path):
    plan = plan_serve(str(tmp_path), pages="default", store="default", environ={})
    assert "--additional-config" in plan.argv and "--kv-transfer-config" in plan.argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in dict(plan.env)
    assert "blocks stored as their packed pages" in plan.summary


def test_store_shared_through_redis(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("K", "11" * 32)
    plan = plan_serve(
        "some/model", store="default", remote="redis://:pw@127.0.0.1:6379/2", remote_ttl=600, remote_key="env:K",
        environ={},
    )  # fmt: skip
    extra = json.loads(_flag(list(plan.argv), "--kv-transfer-config"))["kv_connector_extra_config"]
    assert (extra["kvtier_remote"], extra["kvtier_remote_ttl"]) == ("redis://:pw@127.0.0.1:6379/2", 600)
    assert extra["kvtier_remote_key"] == "env:K" and "redis://:***@127.0.0.1:6379/2" in plan.summary
    assert main(["serve", "m", "--store", "default", "--remote", "redis://u:pw@h:1/0", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "u:***@h:1" in err and ":pw@" not in err  # the printed command hides the password
    with pytest.raises(ValueError, match="add --store"):
        plan_serve("m", remote="redis://h:1/0", environ={})
    with pytest.raises(ValueError, match="add --remote"):
        plan_serve("m", store="default", remote_ttl=5, environ={})
    with pytest.raises(ValueError, match="remote="):
        plan_serve("m", store="default", remote="http://h:1", environ={})


def test_dry_run_refuses_an_empty_model_and_a_remote_key_the_server_could_not_read(tmp_path, capsys, monkeypatch):
    """``kvtier serve "" --dry-run`` and ``--remote-key env:UNSET --dry-run`` passed; both failed only
    after the server's start. The key is read as the server reads it (``load_key``)."""
    assert main(["serve", "", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kvtier serve: MODEL is empty: expected a built-in name (smollm2-135m, ...) or a model folder"
    monkeypatch.delenv("KVTIER_TEST_KEY", raising=False)
    (tmp_path / "short").write_text("11" * 16)
    remote = ["serve", "m", "--store", "default", "--remote", "redis://h:1/0", "--dry-run", "--remote-key"]
    for source, message in (
        ("env:KVTIER_TEST_KEY", "the environment variable KVTIER_TEST_KEY is not set"),
        (
            f"file:{tmp_path / 'missing'}",
            f"the key file cannot be read (key file {tmp_path / 'missing'} does not exist)",
        ),
        (
            "file:/dev/zero",
            "the key file cannot be read (key file /dev/zero is not a regular file (a FIFO, a device or a socket))",
        ),
        (f"file:{tmp_path / 'short'}", "expected a 32-byte key as 64 hex digits or base64"),
    ):
        assert main([*remote, source]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"kvtier serve: remote_key={source!r}: {message}"
    monkeypatch.setenv("KVTIER_TEST_KEY", "11" * 32)
    assert main([*remote, "env:KVTIER_TEST_KEY"]) == 0
    assert "11" * 32 not in capsys.readouterr().err  # the command names the source, never the key
