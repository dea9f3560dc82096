"""Follow an engine's configuration through the calls that pass it on, read from the source
(issue 25; `scripts/config_path.py` measures the same at run time, objects by identity).

Static, with `ast` over pdkv/, nothing imported or run:
- Start: `LLMEngine.__init__` in pdkv/engine/llm_engine.py with its argument `config` tainted.
- What is followed (default): the configuration objects themselves. An expression IS the
  configuration when it is a tainted name (`config`, `self.x`), one of EngineConfig's config
  parts read from one (`config.cache_config`, `self.config.parallel_config`; PARTS), or
  `dataclasses.replace(<that>, ...)`. With --values, every value read from it is followed as
  well (`block_size = config.cache_config.block_size`, an object built from it, ...): then the
  path is every piece of start-up code that anything derived from the configuration reaches.
- In a function, a name (or `self.x`, for the rest of that function) is tainted when it is a
  tainted parameter or is assigned from such an expression.
- A call passes the configuration on when one of its arguments is such an expression. Its callee
  is resolved where the source says which function it is: a function or class of the same module
  or imported from a pdkv module (a class means its `__init__`), `module.function` of an imported
  pdkv module, `self.method` / `cls.method` in the same class, `Class.method` of a resolved class.
  Calls whose callee cannot be named that way (methods of objects, callbacks) are not followed.
  The callee's parameters that receive a tainted argument are tainted, and its body is walked in
  turn (depth first, in source order; each (function, tainted parameters) once).
- The path: the files of the functions entered, in the order they were entered, runs of one file
  collapsed. "Files entered" counts distinct files; a "return" is an entry whose file is already
  earlier on the path (the path left that file and came back to it).

Usage: python scripts/config_flow.py [--root DIR] [--values] [--functions]
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

START = ("pdkv.engine.llm_engine", "LLMEngine.__init__", ("config",))


@dataclass
class Module:
    """One parsed module: its functions and classes by qualified name and its import map."""

    name: str
    path: Path
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)


def load(root: Path) -> dict[str, Module]:
    """Every module of pdkv/ under `root`, parsed."""
    mods: dict[str, Module] = {}
    for path in sorted((root / "pdkv").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mod = Module(name, path)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                mod.classes.add(node.name)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        mod.functions[f"{node.name}.{item.name}"] = item
        for imp in ast.walk(tree):
            if isinstance(imp, ast.ImportFrom) and imp.module and imp.level == 0:
                for a in imp.names:
                    mod.imports[a.asname or a.name] = (imp.module, a.name)
            elif isinstance(imp, ast.Import):
                for a in imp.names:
                    mod.imports[a.asname or a.name.split(".")[0]] = (a.name, None)
        mods[name] = mod
    return mods


PARTS = ("model_config", "cache_config", "scheduler_config", "parallel_config",
         "kv_transfer_config")
"""EngineConfig's fields that are config dataclasses (what scripts/config_path.py follows)."""


def is_config(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether `expr` IS a config object: a tainted name (`x`, `self.x`), one of EngineConfig's
    config parts read from one (`config.cache_config`, `self.config.parallel_config`; PARTS), or
    `replace(<that>, ...)`."""
    if isinstance(expr, ast.Name):
        return expr.id in tainted
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and f"{expr.value.id}.{expr.attr}" in tainted:
            return True
        return expr.attr in PARTS and is_config(expr.value, tainted)
    if isinstance(expr, ast.Call) and isinstance(expr.func, (ast.Name, ast.Attribute)):
        name = expr.func.id if isinstance(expr.func, ast.Name) else expr.func.attr
        return name == "replace" and bool(expr.args) and is_config(expr.args[0], tainted)
    return False


def reads(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether `expr` reads a tainted name (`x` or `self.x`) anywhere in it."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and node.id in tainted:
            return True
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and f"{node.value.id}.{node.attr}" in tainted):
            return True
    return False


class Flow:
    """The walk: `path` (file per function entered) and `entered` (module, function)."""

    def __init__(self, mods: dict[str, Module], values: bool = False) -> None:
        self.mods = mods
        self.hot = reads if values else is_config
        self.seen: set[tuple[str, str, frozenset[str]]] = set()
        self.entered: list[tuple[str, str]] = []

    def resolve(self, mod: Module, cls: str | None, func: ast.expr) -> tuple[str, str] | None:
        """(module, qualified function) a call's callee names, or None."""
        target: tuple[str, str | None] | None = None
        if isinstance(func, ast.Name):
            if func.id in mod.functions or func.id in mod.classes:
                target = (mod.name, func.id)
            elif func.id in mod.imports:
                target = mod.imports[func.id]
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            if base in ("self", "cls") and cls and f"{cls}.{func.attr}" in mod.functions:
                return mod.name, f"{cls}.{func.attr}"
            if base in mod.classes and f"{base}.{func.attr}" in mod.functions:
                return mod.name, f"{base}.{func.attr}"
            if base in mod.imports:
                m, sym = mod.imports[base]
                if sym is None and m in self.mods:
                    target = (m, func.attr)
                elif sym is not None:
                    sub = f"{m}.{sym}"
                    if sub in self.mods:
                        target = (sub, func.attr)
                    elif m in self.mods and sym in self.mods[m].classes:
                        target = (m, f"{sym}.{func.attr}")
        if target is None or target[1] is None:
            return None
        m, sym = target
        while m in self.mods and sym not in self.mods[m].functions \
                and sym not in self.mods[m].classes and sym in self.mods[m].imports:
            m, nxt = self.mods[m].imports[sym]  # re-exported
            if nxt is None:
                return None
            sym = nxt
        if m not in self.mods:
            return None
        if sym in self.mods[m].classes:
            sym = f"{sym}.__init__"
        return (m, sym) if sym in self.mods[m].functions else None

    def walk(self, modname: str, qual: str, tainted_params: frozenset[str]) -> None:
        key = (modname, qual, tainted_params)
        if key in self.seen:
            return
        self.seen.add(key)
        self.entered.append((modname, qual))
        mod = self.mods[modname]
        fn = self.mods[modname].functions[qual]
        cls = qual.split(".")[0] if "." in qual else None
        tainted = set(tainted_params)
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                        and self.hot(node.value, tainted)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                tainted.add(n.id)
                            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                                tainted.add(f"{n.value.id}.{n.attr}")
                if isinstance(node, ast.Call):
                    self.call(mod, cls, node, tainted)

    def call(self, mod: Module, cls: str | None, node: ast.Call, tainted: set[str]) -> None:
        hot_pos = [i for i, a in enumerate(node.args) if self.hot(a, tainted)]
        hot_kw = [k.arg for k in node.keywords if k.arg and self.hot(k.value, tainted)]
        if not hot_pos and not hot_kw:
            return
        callee = self.resolve(mod, cls, node.func)
        if callee is None:
            return
        fn = self.mods[callee[0]].functions[callee[1]]
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if params and params[0] in ("self", "cls"):
            params = params[1:]
        names = {params[i] for i in hot_pos if i < len(params)}
        names |= {k for k in hot_kw if k in params or k in [a.arg for a in fn.args.kwonlyargs]}
        if names:
            self.walk(callee[0], callee[1], frozenset(names))


def path_of(mods: dict[str, Module], entered: list[tuple[str, str]], root: Path) -> list[str]:
    files = [str(mods[m].path.relative_to(root)) for m, _ in entered]
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def measure(root: Path, values: bool = False) -> tuple[list[str], list[tuple[str, str]]]:
    """(the path: files relative to `root`, runs collapsed; the functions entered, in order)."""
    mods = load(root)
    flow = Flow(mods, values=values)
    flow.walk(START[0], START[1], frozenset(START[2]))
    return path_of(mods, flow.entered, root), flow.entered


def returns_of(path: list[str]) -> int:
    """Entries of `path` whose file is already earlier on it."""
    return sum(1 for i, f in enumerate(path) if f in path[:i])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                    help="repository root (default: this checkout)")
    ap.add_argument("--functions", action="store_true", help="list every function entered")
    ap.add_argument("--values", action="store_true",
                    help="follow every value read from the configuration too, not only the "
                         "configuration objects")
    args = ap.parse_args()
    path, entered = measure(Path(args.root), args.values)
    print(f"files entered: {len(set(path))}")
    print(f"returns: {returns_of(path)}")
    print("path:")
    for f in path:
        print(f"  {f}")
    if args.functions:
        print("functions:")
        for m, q in entered:
            print(f"  {m}.{q}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
