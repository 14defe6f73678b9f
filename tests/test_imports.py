"""The package's import structure: no import cycles, and a core that imports without transformers.

The import graph is read from the source (AST), not from ``sys.modules``: module-level and
function-level imports both count (a function-level import only hides a cycle until that function
runs), imports under ``if TYPE_CHECKING:`` do not (they never run). An edge goes to the module an
import names; a package counts as its ``__init__``; ``from pkg import name`` goes to ``pkg.name``
when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of kvtier (a package under its own name)."""
    out = {}
    for path in sorted((SRC / "kvtier").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    """Every import statement under ``node`` (any depth), except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph() -> dict[str, list[str]]:
    """kvtier module -> the kvtier modules it imports (module- and function-level)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in mods)
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in mods:
                    edges.add(f"{target}.{alias.name}")
                elif target in mods:
                    edges.add(target)
        edges.discard(name)
        graph[name] = sorted(edges)
    return graph


def find_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle path ``[a, b, ..., a]`` per strongly connected component with a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # shortest way back to the component's first module
        start = min(comp)
        prev = {start: None}
        queue = [start]
        while queue:
            v = queue.pop(0)
            nxt = [w for w in graph[v] if w in comp]
            if start in nxt:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                cycles.append([start, *reversed(path[:-1]), start] if v != start else [start, start])
                break
            for w in nxt:
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
    return cycles


def test_graph_reader_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "kvtier.stats" in graph["kvtier.cache.state"]  # module level, relative
    assert "kvtier.offload.prefetch" in graph["kvtier.cache.state"]  # function level
    assert "kvtier.attention.partials" in graph["kvtier.attention.tiered"]  # from . import partials
    assert "kvtier.hf" in graph["kvtier.adapters"]  # a package (lazy adapter import) counts as its __init__
    assert "kvtier.offload" in graph["kvtier"]  # from .offload import OffloadError: the package
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in src/kvtier:\n" + "\n".join(" -> ".join(c) for c in cycles)


#: kvtier's layers, lowest first (DESIGN.md, CONTRIBUTING.md): an import may point to its own layer or
#: a lower one, never up. Each entry is a module or package (with everything under it); ``kvtier`` alone
#: is the top-level package's ``__init__`` (the lazy ``kvtier.TieredCache`` names), not all of kvtier.
LAYERS = [
    [
        "kvtier.errors",
        "kvtier.stats",
        "kvtier.indexing",
        "kvtier.tier",
        "kvtier.testing",
        "kvtier.inputs",
    ],  # leaf modules
    ["kvtier.policy"],
    ["kvtier.quant"],
    ["kvtier.codecs"],
    ["kvtier.kernels"],
    ["kvtier.offload"],  # storage: block store, records, sketches, the offloaded tier, prefetch
    ["kvtier.cache"],  # tiers and the per-layer state machine (drives the offloaded tier)
    ["kvtier.attention"],  # incl. attention over offloaded blocks
    ["kvtier.sizing", "kvtier.diagnostics"],
    ["kvtier.hf", "kvtier.vllm", "kvtier.adapters", "kvtier"],  # the adapters and the names forwarded to hf
    ["kvtier.eval", "kvtier.cli", "kvtier.doctor", "kvtier.models", "kvtier.vllm.serve"],  # commands
]


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the longest entry that is ``module`` or a package above it."""
    best = None
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            inside = module == entry or (entry != "kvtier" and module.startswith(entry + "."))
            if inside and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    return None if best is None else best[0]


def upward_imports(graph: dict[str, list[str]]) -> list[str]:
    """``"a (layer i) -> b (layer j)"`` for every import from a lower layer ``i`` to a higher ``j``."""
    return [
        f"{m} (layer {layer_of(m)}) -> {t} (layer {layer_of(t)})"
        for m in sorted(graph)
        for t in graph[m]
        if layer_of(t) > layer_of(m)
    ]


def test_every_module_has_a_layer():
    entries = [e for layer in LAYERS for e in layer]
    assert len(entries) == len(set(entries)), "a module or package is named in two layers"
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules in no layer of LAYERS (add them where their imports allow): {missing}"


def test_imports_point_down_the_layers():
    assert layer_of("kvtier.codecs.kbit") == layer_of("kvtier.codecs") < layer_of("kvtier.kernels.build")
    assert layer_of("kvtier") == layer_of("kvtier.hf") < layer_of("kvtier.eval.results")
    assert upward_imports({"kvtier.quant": ["kvtier.policy"], "kvtier.policy": ["kvtier.quant.bits"]}) == [
        "kvtier.policy (layer 1) -> kvtier.quant.bits (layer 2)"
    ]
    up = upward_imports(import_graph())
    assert not up, f"{len(up)} imports from a lower layer to a higher one:\n" + "\n".join(up)


def test_vllm_store_and_pages_never_import_each_other():
    """``kvtier.vllm.store`` (the prefix store) and ``kvtier.vllm.pages`` (the packed-page backend) share
    the adapters' layer and nothing else: what they both need sits below them (codecs, quant, kernels).
    (They are not a layer of their own: the store's log line reads ``kvtier.__version__``.) One edge is
    allowed: the store reads an engine's page policy (``pages.policy``, a leaf of pure Python) to keep
    blocks of packed pages as they are."""
    graph = import_graph()
    store, pages = "kvtier.vllm.store", "kvtier.vllm.pages"
    assert {store, pages, store + ".spec", pages + ".backend"} <= set(graph)
    crossing = [
        f"{m} -> {t}"
        for m in graph
        for t in graph[m]
        for a, b in ((store, pages), (pages, store))
        if (m == a or m.startswith(a + "."))
        and (t == b or t.startswith(b + "."))
        and not (m.startswith(store + ".") and t == pages + ".policy")
    ]
    assert not crossing, crossing


# A meta path finder that makes ``transformers`` (and its submodules) impossible to import.
BLOCK_TRANSFORMERS = textwrap.dedent(
    """
    import sys

    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" or name.startswith("transformers."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, _Block())
    """
)

CORE = textwrap.dedent(
    """
    import kvtier
    kvtier.TierPolicy()
    kvtier.get_policy("default")
    import kvtier.sizing, kvtier.cache.tiers, kvtier.codecs, kvtier.cache.state, kvtier.offload.store
    import kvtier.offload.tier, kvtier.kernels.cpu, kvtier.quant, kvtier.attention.tiered, kvtier.diagnostics
    import kvtier.cli
    assert kvtier.cli.main(["plan", "--model", "llama-2-13b", "--seq-len", "32768", "--json"]) == 0
    for owner, name in ((kvtier, "TieredCache"), (kvtier, "enable"), (kvtier, "TieredLayer")):
        try:
            getattr(owner, name)
        except ImportError as err:
            assert "needs transformers" in str(err) and "kvtier[hf]" in str(err), err
            print("clear:", err)
        else:
            raise AssertionError(f"{owner.__name__}.{name} imported without transformers")
    assert not any(m == "transformers" or m.startswith("transformers.") for m in sys.modules)
    print("core ok")
    """
)


def test_core_imports_without_transformers():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TRANSFORMERS + CORE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SRC.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "core ok" in proc.stdout
    assert '"model": "llama-2-13b"' in proc.stdout or "llama-2-13b" in proc.stdout


@pytest.mark.parametrize("name", ["TieredCache", "TieredLayer", "enable", "disable", "register"])
def test_adapter_names_still_resolve_with_transformers(name):
    import kvtier

    hf = pytest.importorskip("kvtier.hf", reason="needs the transformers adapter (kvtier[hf])", exc_type=ImportError)
    assert getattr(kvtier, name) is getattr(hf, name)


def _kernel_chains(policy: str) -> list[list[str]]:
    """The kvtier modules on the stack (outermost first, consecutive repeats folded) each time a
    decode step's ``kvtier_attention`` calls into a kernel module (``kvtier.kernels.*``, the
    builder aside), on a tiny Qwen2 with every tier filled (the step after a warm-up step)."""
    import torch

    import kvtier
    from kvtier.testing import feed, random_ids, tiny_qwen2

    chains: list[list[str]] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        name = frame.f_globals.get("__name__", "")
        if event != "call" or not name.startswith("kvtier.kernels.") or name == "kvtier.kernels.build":
            return
        chain, f = [], frame
        while f is not None:
            mod = f.f_globals.get("__name__", "")
            if mod.startswith("kvtier") and (not chain or chain[-1] != mod):
                chain.append(mod)
            if mod == "kvtier.attention.interface" and f.f_code.co_name == "kvtier_attention":
                chains.append(chain[::-1])
                return
            f = f.f_back

    model = tiny_qwen2()
    with kvtier.enable(model), kvtier.TieredCache(model.config, policy) as cache, torch.no_grad():
        feed(model, cache, random_ids(1100), chunk=64)
        model(random_ids(1, seed=4), cache=cache, use_cache=True)  # warm-up: kernels loaded
        sys.setprofile(profile)
        try:
            model(random_ids(1, seed=5), cache=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    return chains


@pytest.mark.parametrize("policy", ["default", "offload-cpu", "adaptive"])
def test_a_query_reaches_a_kernel_through_at_most_8_modules(policy):
    """Issue 35's bound on a query's path: from ``kvtier_attention`` to the kernel that attends,
    at most 8 modules (a decode step through the fused C++ path where it is built)."""
    from kvtier.kernels import fused_cpu

    if not fused_cpu.available():
        pytest.skip("the fused C++ kernel is not built here")
    chains = _kernel_chains(policy)
    assert chains, "no call reached a kernel module"
    longest = max(chains, key=lambda c: len(set(c)))
    assert len(set(longest)) <= 8, " > ".join(longest)
