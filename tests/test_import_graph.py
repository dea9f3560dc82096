"""pdkv's import graph against its layering (docs/ARCHITECTURE.md, "Layers"): every `pdkv.*`
import in pdkv/ (module level, function-local and TYPE_CHECKING alike: they couple all the same)
read with `ast`, no import executed. A package may import its own modules and the layers below
it; there is no cycle between modules. What breaks either today is listed below as known debt, so
the test fails on any new upward import or cycle, and also when a debt entry is paid (delete the
entry then)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first; a module's layer is its first name under pdkv (a package or a
# top-level module). A layer may import the layers before it in this list, never after.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "sampling_params",
        "procgroup",
        "cli_parser",
        "outputs",
        "block_hashing",
        "jsontypes",
        "ports",
        "keepalive",
        "malloc_tuning",
    ),  # leaves
    ("kv_events",),  # KV cache event schema, --kv-events-config, the ZMQ publisher
    ("request",),  # a request and its state
    ("cache",),  # blocks, block pool, KV cache manager (torch-free)
    ("modelspec",),  # a model's state groups from its HF config (torch-free)
    ("parallel",),  # TP / DCP layout and process-group context
    ("model",),  # model code, attention, ops, loading
    ("plan",),  # cost model (torch-free), reads model configs
    ("tokenizer", "config"),  # engine configuration
    ("kvpool",),  # the KV pool's store and tiers
    ("sched",),  # the scheduler
    ("kv_transfer",),  # KV connectors and transfer engines
    ("worker",),  # model runner, KV cache allocation
    ("executor",),  # in-process / multiproc execution
    ("engine", "__init__"),  # LLMEngine, LLM, AsyncLLM (`pdkv` re-exports LLM and the rest)
    ("serve",),  # the OpenAI server
    ("router",),  # proxy, routing policies, pool topology specs
    ("launch",),  # `pdkv up`: launcher, pool servers (redis, mooncake), free ports, demo
    ("matrix", "bench", "report"),  # tools (report: the figures of the guides, `pdkv report`)
    ("cli",),  # the entry point
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}

# Imports that point up the layering today: (importer module, imported module); none left
# (model/arch_config.py read its state kinds through pdkv.plan until the reader moved to
# pdkv.modelspec).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# Import cycles today, each as the sorted modules of one strongly connected component (none
# left: base.py <-> sched/output.py, factory.py <-> multi.py, fused_ops.py <-> llama.py and
# demo.py <-> launcher.py were broken when this test came).
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the `pdkv` package under `root`, by dotted name."""
    return {module_name(p, root): p for p in sorted((root / "pdkv").rglob("*.py"))}


def _targets(
    node: ast.AST, importer: str, is_package: bool, known: dict[str, Path]
) -> Iterator[str]:
    """The pdkv modules an import statement names (`from pdkv.x import y`: pdkv.x.y when that is
    a module, else pdkv.x)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = importer.split(".") if is_package else importer.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known and name != importer and name.startswith("pdkv"):
            yield name


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the pdkv modules it imports anywhere in its file."""
    known = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {t for node in ast.walk(tree)
                       for t in _targets(node, name, path.name == "__init__.py", known)}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, bs in graph.items() for b in bs
            if layer(a) != layer(b) and RANK[layer(b)] > RANK[layer(a)]}


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in modules()} <= set(RANK), sorted(
        {layer(m) for m in modules()} - set(RANK)
    )


def test_no_import_points_up_the_layering_beyond_the_known_debt():
    found = upward_imports(import_graph())
    assert found - KNOWN_UPWARD == set(), f"new upward imports: {sorted(found - KNOWN_UPWARD)}"
    assert KNOWN_UPWARD - found == set(), (
        f"paid debt, delete from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - found)}"
    )


def test_no_import_cycle_beyond_the_known_debt():
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), f"new cycles: {sorted(found - KNOWN_CYCLES)}"
    assert KNOWN_CYCLES - found == set(), (
        f"paid debt, delete from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"
    )


def test_the_checks_see_function_local_and_type_only_imports(tmp_path):
    """The reader on a tiny package: a TYPE_CHECKING import and a function-local one close a
    cycle, and a relative import resolves."""
    pkg = tmp_path / "pdkv"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pdkv.low.b import B\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from .a import A\n")
    (pkg / "up.py").write_text("import pdkv.low.a\n")
    graph = import_graph(tmp_path)
    assert graph == {"pdkv": set(), "pdkv.low": set(), "pdkv.low.a": {"pdkv.low.b"},
                     "pdkv.low.b": {"pdkv.low.a"}, "pdkv.up": {"pdkv.low.a"}}
    assert cycles(graph) == {("pdkv.low.a", "pdkv.low.b")}
