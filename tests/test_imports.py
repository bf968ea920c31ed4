"""The package's import graph: no cycles, and no module imports a layer above its own.

Every ``import`` and ``from ... import`` of elastic_vllm counts, at module level and inside functions (a
function-local import is a dependency too, only a later one). ``from P import name`` is an edge to the module
``P.name`` when that is a module, else to ``P``; importing a submodule is not an edge to its package's __init__
(Python runs it, but a package re-exporting its modules is not a dependency of those modules on it).

The layers, bottom to top; a module may import its own layer and the ones below:

    0 config, provenance, models   the settings, the run record, the demo model's files: nothing of the method
    1 router                       the router module and its checkpoints (torch only)
    2 reference, ops, sparsity     the plain-PyTorch oracle, the Triton kernels beside it, the sparsity measures
    3 telemetry                    metrics and their exporter: read routing results, know no engine
    4 hf, vllm_plugin              the two integrations (transformers; vLLM), side by side: neither imports the other
    5 server, supervisor           `elastic-vllm serve` (supervisor.py: runs and watches `vllm serve`, its early
                                   checks are the plugin's precheck) and the subprocess handle the demo, tests and
                                   benchmarks use (server.py)
    6 train, eval                  router training and evaluation on the transformers integration, side by side:
                                   the evaluation reads the training mixture's families, the training's finish
                                   ranks retrieval heads with the evaluation's needle scoring
    7 demo, cli                    what a user runs

Why this order: the method (router, references, kernels) must not know how it is served; the integrations are the
only places that know transformers or vLLM (tested apart, upgraded apart); the supervisor starts vLLM with the plugin
and checks its configuration first, so it sits above both; training and evaluation use the integrations; the CLI
wires everything. Within a layer parts may import each other (hf and vllm_plugin excepted), without cycles.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "elastic_vllm"
LAYERS = {
    "config": 0, "provenance": 0, "models": 0,
    "router": 1,
    "reference": 2, "ops": 2, "sparsity": 2,
    "telemetry": 3,
    "hf": 4, "vllm_plugin": 4,
    "server": 5, "supervisor": 5,
    "train": 6, "eval": 6,
    "demo": 7, "cli": 7,
}  # fmt: skip
SIDE_BY_SIDE = {("hf", "vllm_plugin"), ("vllm_plugin", "hf")}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith("elastic_vllm") else None
                if r and r != m:
                    edges[m].add(r)
    return edges


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(comp))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    parts = {part(m) for m in modules()} - {""}
    assert parts <= set(LAYERS), f"modules without a layer: {sorted(parts - set(LAYERS))}"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for a, targets in sorted(import_graph().items()):
        for b in sorted(targets):
            pa, pb = part(a), part(b)
            if pa and pb and pa != pb and (LAYERS[pb] > LAYERS[pa] or (pa, pb) in SIDE_BY_SIDE):
                bad.append(f"{a} -> {b}")
    assert bad == []


def test_the_graph_sees_function_local_imports():
    """The guard reads imports inside functions too: the supervisor's import of the precheck is function-local."""
    g = import_graph()
    assert "elastic_vllm.config" in g["elastic_vllm.sparsity"] and g["elastic_vllm.cli"]
    assert "elastic_vllm.vllm_plugin.precheck" in g["elastic_vllm.supervisor"]
