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
