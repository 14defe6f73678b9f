"""Where the C++ of the CPU kernels lives: in ``src/kvtier/kernels/csrc/`` (shipped as package data),
never in Python strings; each kernel module builds from it, or warns and falls back to torch.

The kernels' results are tested against their references in ``tests/test_attention.py`` and
``tests/test_offload.py``; this file only checks the sources, the build and the packaging.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from kvtier.kernels.build import cpu_has_avx512

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "kvtier"
CSRC = PKG / "kernels" / "csrc"

#: Kernel module -> the function its C++ exports.
KERNELS = {
    "cpu": "packed_attention",
    "fused_cpu": "layer_attention",
    "sketch_cpu": "sketch_block_lse",
    "vllm_paged_cpu": "vllm_paged_attend",
    "offload_cpu": "offload_attend",
    "parallel": "parallel_threads",
    "prefill_cpu": "prefill_attend",
    "vq_cpu": "vq_attention",
}

#: Kernels that also need an instruction set beyond AVX-512F: module -> the C++ function saying whether it was built in.
NEEDS_ISA = {"prefill_cpu": "prefill_supported"}

#: Text that only a C++ kernel body (or its bindings) would put in a Python file.
CPP_MARKERS = ("#include <", "TORCH_LIBRARY", "PYBIND11", "TORCH_CHECK(", "torch::Tensor", "at::parallel_for")

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def _python_files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _is_load_inline(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == "load_inline") or (
        isinstance(f, ast.Attribute) and f.attr == "load_inline"
    )


def _build_load_files(path: Path) -> list[str]:
    """Second arguments of the ``build.load(...)`` calls in a kernel module: the csrc files it builds."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "build":
                arg = node.args[1]  # one file, or a tuple of files built as one module
                names = arg.elts if isinstance(arg, (ast.Tuple, ast.List)) else [arg]
                for name in names:
                    assert isinstance(name, ast.Constant) and isinstance(name.value, str), ast.dump(arg)
                    out.append(name.value)
    return out


def test_no_python_file_holds_a_cpp_kernel():
    bad = []
    for path in _python_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(PKG)
        bad += [f"{rel}: {marker!r}" for marker in CPP_MARKERS if marker in text]
        if "load_inline(" in text and rel != Path("kernels/build.py"):
            bad.append(f"{rel}: load_inline( outside kernels/build.py")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and _is_load_inline(node):
                args = [*node.args, *(k.value for k in node.keywords)]
                literal = [a for arg in args for a in ast.walk(arg) if isinstance(a, (ast.Constant, ast.JoinedStr))]
                if any(isinstance(a, ast.JoinedStr) or isinstance(a.value, str) for a in literal):
                    bad.append(f"{rel}:{node.lineno}: load_inline with a string literal")
    assert not bad, "C++ belongs in src/kvtier/kernels/csrc/:\n" + "\n".join(bad)


def test_every_csrc_file_is_used_and_every_kernel_file_exists():
    from kvtier.kernels import build

    built = sorted(f for name in KERNELS for f in _build_load_files(PKG / "kernels" / f"{name}.py"))
    assert built == sorted(p.name for p in CSRC.glob("*.cpp"))
    included = {m for p in CSRC.glob("*.cpp") for m in _LOCAL_INCLUDE.findall(p.read_text(encoding="utf-8"))}
    generated = set(build.generated())
    assert not any((CSRC / name).exists() for name in generated), "a generated header is written from Python only"
    assert included == {p.name for p in CSRC.glob("*.h")} | generated


@pytest.mark.parametrize("filename", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_the_compiled_text_has_its_csrc_includes_in_place(filename):
    from kvtier.kernels import build

    text = build.source(filename)
    assert not _LOCAL_INCLUDE.search(text)
    generated = build.generated()
    for header in _LOCAL_INCLUDE.findall((CSRC / filename).read_text(encoding="utf-8")):
        body = generated[header]() if header in generated else (CSRC / header).read_text(encoding="utf-8")
        assert text.count(body.rstrip("\n")) == 1
    # nothing in it depends on where the package is installed (one cached build for every install)
    assert str(ROOT) not in text


def test_a_module_of_several_sources_has_each_header_once():
    """One module built from several ``.cpp`` files (``vllm_paged_cpu``'s one file per call) is one
    text: each file in order, each header's text once, at its first include."""
    from kvtier.kernels import build

    files = _build_load_files(PKG / "kernels" / "vllm_paged_cpu.py")
    assert len(files) > 1
    text = build.sources(files)
    assert not _LOCAL_INCLUDE.search(text)
    for header in {h for f in files for h in _LOCAL_INCLUDE.findall((CSRC / f).read_text(encoding="utf-8"))}:
        body = build.source(header)
        assert text.count(body.rstrip("\n")) == 1, header
    positions = [text.index(build.source(f).splitlines()[0]) for f in files]
    assert positions == sorted(positions)
    assert build.sources(files[0]) == build.source(files[0])


def _can_build() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_kernel_builds_or_falls_back_with_a_warning(name):
    module = importlib.import_module(f"kvtier.kernels.{name}")
    if _can_build():
        assert callable(getattr(module._module(), KERNELS[name]))
        if name in NEEDS_ISA:  # built everywhere, available where the CPU has the instructions
            assert module.available() == bool(getattr(module._module(), NEEDS_ISA[name])())
        else:
            assert module.available(), f"kvtier.kernels.{name} did not build although a compiler and ninja exist"
    else:
        module.available.cache_clear()
        with pytest.warns(UserWarning, match="unavailable, using"):
            assert module.available() is False


def test_a_missing_source_warns_and_falls_back():
    from kvtier.kernels import build

    load = lambda: build.load("kvtier_missing_v1", "missing.cpp", ["missing"])
    with pytest.warns(UserWarning, match="demo kernel unavailable, using the torch path: .*missing.cpp"):
        assert build.check(load, "demo kernel", "the torch path") is False


def test_kernels_run_on_torchs_threads():
    """at::parallel_for runs serially in a kernel built without OpenMP (it did until this test):
    the probe, built with every kernel's flags, must use the threads torch is given."""
    if not _can_build():
        pytest.skip("no C++ compiler or ninja")
    import torch

    from kvtier.kernels import parallel

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert parallel.threads() == 1
        if (os.cpu_count() or 1) >= 2:
            torch.set_num_threads(2)
            assert parallel.threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_compiler_without_openmp_gets_a_serial_build_with_a_warning(monkeypatch):
    if not _can_build():
        pytest.skip("no C++ compiler or ninja")
    import torch

    from kvtier.kernels import build

    monkeypatch.setattr(build, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.warns(UserWarning, match="kvtier_probe_v1 built without OpenMP .* one thread"):
            module = build.load("kvtier_probe_v1", "parallel_probe.cpp", ["parallel_threads"])
        assert module.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


def test_cpp_sources_are_package_data():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["kvtier"]
    assert "data/*.txt" in patterns
    files = [p.relative_to(PKG).as_posix() for p in CSRC.rglob("*") if p.is_file()]
    assert any(f.endswith(".h") for f in files) and any(f.endswith(".cpp") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, pat) for pat in patterns)]
    assert not missing, f"not shipped in a wheel: {missing}"


@pytest.mark.parametrize("filename", sorted(p.name for p in CSRC.glob("*.cpp") if "__AVX512F__" in p.read_text()))
def test_sources_with_avx512_paths_also_compile_for_the_other_isa(filename, tmp_path):
    """A kernel with AVX-512 block routines must compile both with and without them: the build here
    covers this machine's side, a syntax-only compile with the other side's flags the other (a
    name used only in a discarded ``if constexpr`` branch still has to be declared)."""
    if not _can_build():
        pytest.skip("no C++ compiler or ninja")
    import subprocess

    from torch.utils.cpp_extension import include_paths

    from kvtier.kernels import build

    flip = ["-mno-avx512f"] if cpu_has_avx512() else ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    src = tmp_path / filename
    src.write_text("#include <torch/extension.h>\n" + build.source(filename))
    cmd = [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", *build.BASE_CFLAGS, *flip, str(src)]
    cmd += [f"-I{p}" for p in include_paths()] + [f"-isystem{sysconfig_include()}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def sysconfig_include() -> str:
    import sysconfig

    return sysconfig.get_paths()["include"]


def test_a_left_over_build_lock_is_named_before_torch_waits_on_it(tmp_path, monkeypatch):
    from kvtier.kernels import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.lock_notice("kvtier_demo_v1") is None
    (tmp_path / "kvtier_demo_v1" / "lock").touch()
    notice = build.lock_notice("kvtier_demo_v1")
    assert notice and str(tmp_path / "kvtier_demo_v1" / "lock") in notice and "delete it" in notice


# --- one owner per constant: the codec constants come from Python, never as literals in C++ or Triton ---

#: A C or C++ floating literal: hex (``0x1p-20f``) or decimal with a point or an exponent, any suffix.
_CPP_FLOAT = re.compile(
    r"(?<![\w.])(0[xX][0-9a-fA-F]*\.?[0-9a-fA-F]*[pP][+-]?\d+|(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)[fFlL]?"
)


def _cpp_code(text: str) -> str:
    """C++ text without its comments (a literal in a comment restates nothing the compiler reads)."""
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))


def _cpp_floats(text: str) -> list[tuple[str, float]]:
    out = []
    for m in _CPP_FLOAT.finditer(_cpp_code(text)):
        lit = m.group(1)
        out.append((m.group(0), float.fromhex(lit) if lit[:2].lower() == "0x" else float(lit)))
    return out


def _python_numbers(text: str) -> list[tuple[str, float]]:
    """Every number constant of Python code, and every constant expression of numbers (``2.0**-20``,
    ``1 / 1048576``, ``-512.0``), with its value."""
    import operator

    ops = {
        ast.Pow: operator.pow,
        ast.Div: operator.truediv,
        ast.Mult: operator.mul,
        ast.Add: operator.add,
        ast.Sub: operator.sub,
    }

    def value(node: ast.AST) -> float | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            a, b = value(node.left), value(node.right)
            try:
                return None if a is None or b is None else float(ops[type(node.op)](a, b))
            except (ZeroDivisionError, OverflowError, TypeError):
                return None
        return None

    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.expr) and not isinstance(node, ast.Name):
            v = value(node)
            if v is not None:
                out.append((ast.unparse(node), v))
    return out


def _forbidden() -> dict[float, str]:
    """Value -> the Python name that owns it: the codec constants, and the scale round-up factor."""
    from kvtier.codecs import constants
    from kvtier.quant.groups import SCALE_ROUND

    out = {value: owner for owner, value in constants.CODEC_CONSTANTS.items()}
    out[1 + SCALE_ROUND] = "1 + kvtier.quant.groups.SCALE_ROUND"
    return out


def test_the_literal_scanners_see_every_spelling():
    forbidden = _forbidden()
    cpp = "x = std::max(s, 9.5367431640625e-07f); y = a / 512.f; z = 0x1p-20f * 1.0009765625f; w = 5.12e2;"
    assert [v in forbidden for _, v in _cpp_floats(cpp)] == [True, True, True, True, True]
    assert _cpp_floats("// 512.f only in a comment\n/* 448.0 */ int n = 512;") == []
    py = "a = 2.0**-20\nb = x / 512.0\nc = 1 / 1048576\nd = 448\ne = 2**-14\nf = (1 + 2.0**-10)"
    assert {owner for _, v in _python_numbers(py) if (owner := forbidden.get(v))} == set(forbidden.values())


def test_no_kernel_source_restates_a_codec_constant():
    """SCALE_EPS, ZERO_MAX, SCALE_ROUND (kvtier.quant.groups) and the fp8 format's FP8_MAX /
    FP8_SCALE_MIN have one definition, in Python: C++ reads them from the generated
    ``codec_constants.h`` (kvtier.codecs.constants), Triton takes them as arguments."""
    forbidden = _forbidden()
    hits = []
    for path in sorted(CSRC.glob("*")):
        hits += [(path.name, lit, v) for lit, v in _cpp_floats(path.read_text(encoding="utf-8")) if v in forbidden]
    for path in sorted((PKG / "kernels").glob("triton_*.py")):
        hits += [(path.name, e, v) for e, v in _python_numbers(path.read_text(encoding="utf-8")) if v in forbidden]
    assert not hits, "codec constants restated as literals (read codec_constants.h or pass them in):\n" + "\n".join(
        f"{where}: {lit} (= {forbidden[v]})" for where, lit, v in hits
    )


def test_the_generated_header_holds_the_python_values_and_names_the_build(monkeypatch):
    from kvtier.codecs import constants
    from kvtier.kernels import build

    found = dict(re.findall(r"constexpr float (\w+) = (0x[0-9a-fA-Fp.+-]+)f;", constants.header()))
    assert {name: float.fromhex(lit) for name, lit in found.items()} == {
        name: value for name, (value, _) in constants.KERNEL_CONSTANTS.items()
    }
    users = [p.name for p in CSRC.glob("*.cpp") if constants.HEADER in build._generated_in(p.name)]
    assert users, "no kernel reads the codec constants"
    name = build.module_name("kvtier_demo_v1", users[0])
    assert name.startswith(f"kvtier_demo_v1_{build._torch_tag()}_")
    monkeypatch.setitem(constants.KERNEL_CONSTANTS, "kZeroMax", (256.0, "a changed constant"))
    assert build.module_name("kvtier_demo_v1", users[0]) != name  # a changed constant builds a new module
    monkeypatch.undo()
    assert build.module_name("kvtier_demo_v1", users[0]) == name
    assert build.module_name("kvtier_demo_v1", "packed_attention.cpp") == f"kvtier_demo_v1_{build._torch_tag()}"


# --- one definition per helper: numeric.h holds what the kernels share ---

#: A function definition at namespace level: its head from the start of a line up to ``(``.
_CPP_FUNC = re.compile(
    r"^(?:template <[^\n]*>\n)?(?:(?:inline|static|constexpr) )*[A-Za-z_][\w:<>,*& ]*?[ *&](\w+)\(", re.MULTILINE
)


def _cpp_functions(text: str) -> list[tuple[str, str]]:
    """(name, whitespace-normalized text) of each namespace-level function defined (not declared) in C++ ``text``."""
    code = _cpp_code(text)
    out = []
    for m in _CPP_FUNC.finditer(code):
        brace, semi = code.find("{", m.end()), code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration
        depth, i = 0, brace
        while True:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
            i += 1
        out.append((m.group(1), " ".join(code[m.start() : i + 1].split())))
    return out


def test_every_kernel_includes_numeric_h_and_no_helper_is_defined_twice():
    """The shared numeric helpers (exp, half / bf16 conversions, loads, dots) live in ``numeric.h``,
    included by every kernel; no function is defined in two sources, nor twice with the same body
    under two names (a copied helper)."""
    kernels = [p for p in sorted(CSRC.glob("*.cpp")) if p.name != "parallel_probe.cpp"]
    missing = [p.name for p in kernels if '#include "numeric.h"' not in p.read_text(encoding="utf-8")]
    assert not missing, f"kernels not including numeric.h: {missing}"
    where: dict[str, list[str]] = {}
    bodies: dict[str, list[str]] = {}
    for path in sorted(CSRC.glob("*")):
        for name, body in _cpp_functions(path.read_text(encoding="utf-8")):
            where.setdefault(name, []).append(path.name)
            bodies.setdefault(body.split("(", 1)[1], []).append(f"{path.name}:{name}")
    shared = {"numeric.h", "common.h", "page_codes.h"}
    twice = {n: fs for n, fs in where.items() if len(fs) > 1 and (len(set(fs)) < len(fs) or shared & set(fs))}
    assert not twice, f"functions defined twice (keep one, in a shared header): {twice}"
    copies = [names for names in bodies.values() if len(names) > 1]
    assert not copies, f"functions with the same body (one helper in numeric.h): {copies}"
    assert {"fexp", "half_to_float", "exp512", "dot_n"} <= {n for n, fs in where.items() if fs == ["numeric.h"]}
