"""Check the architecture rules of DESIGN.md on the source tree (run by ``make lint``).

1. No import cycles among the project's modules (module-level, function-level and
   ``TYPE_CHECKING`` imports all count).
2. Adapters (``adapters/``) import the core only through its declared public
   interface: ``ckptbridge`` and ``ckptbridge.plugin`` (never ``ckptbridge._*``, nor the
   public ``ckptbridge.rules`` / ``health`` / ``recipes``: what adapters need is in the plugin).
3. The core (``bridge/``) never imports an adapter, torch or jax at module level
   (frameworks are imported lazily, inside functions of the adapters).
4. The core finds frameworks only through registered providers (entry points): no
   ``sys.modules`` lookups and no private ``jax._src`` paths in ``bridge/``.

Exit 1 with one line per violation::

    python tools/check_architecture.py
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"bridge": "ckptbridge", "adapters": "ckptbridge.adapters"}
ADAPTER_INTERFACE = ("plugin", "adapters")  # ckptbridge.<these> (and ckptbridge itself) for adapters
PROBES = ("sys.modules", "jax._src")  # how a core would find frameworks without their providers
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "optax", "orbax", "tensorstore", "deepspeed", "megatron")


def modules() -> dict[str, str]:
    """Module name -> file, for every module of the two packages."""
    out = {}
    for folder, pkg in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                name = pkg if rel == "__init__" else f"{pkg}.{rel.removesuffix('.__init__')}"
                out[name] = os.path.join(dirpath, f)
    return out


def imports(name: str, path: str, known: set[str]) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in a file."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    is_pkg = path.endswith("__init__.py")
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        level = id(node) in top
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, level
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names]
            yield from ((sub, node.lineno, level) for sub in subs if sub in known)
            if not all(sub in known for sub in subs):  # names from the module itself
                yield mod, node.lineno, level


def main() -> int:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    problems = []
    for name, path in mods.items():
        rel = os.path.relpath(path, ROOT)
        for target, line, level in imports(name, path, set(mods)):
            if target in mods and target != name and not target.startswith(name + "."):
                graph[name].add(target)  # a package's own submodules are its parts, not a dependency
            root = target.split(".")[0]
            if name.startswith("ckptbridge.adapters"):
                core = target.split(".")[1] if target.startswith("ckptbridge.") else None
                if core is not None and core not in ADAPTER_INTERFACE:
                    problems.append(f"{rel}:{line}: adapter imports {target} (only ckptbridge and ckptbridge.plugin)")
            elif name.startswith("ckptbridge"):
                if target.startswith("ckptbridge.adapters"):
                    problems.append(f"{rel}:{line}: core imports adapter {target}")
                if level and root in FRAMEWORKS:
                    problems.append(f"{rel}:{line}: core imports {root} at module level")
        if not name.startswith("ckptbridge.adapters"):
            with open(path) as fh:
                for n, text in enumerate(fh, 1):
                    problems += [f"{rel}:{n}: core looks for a framework through {p} (register a provider)"
                                 for p in PROBES if p in text]
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    for p in problems:
        print(p)
    return 1 if problems else 0


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append([*sorted(comp), sorted(comp)[0]])

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
