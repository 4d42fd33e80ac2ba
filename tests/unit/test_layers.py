"""The package's structure, drawn from its imports: every import goes to the same layer or one below, and there is
no import circle. A layer is a folder (or a module at the root); the order is the data flow's, bottom up:
messages and errors; configuration, datasets, losses, weight transports and the planner; what runs inside a
generator process and what the learner holds; the pipeline on rank 0; the generator pools that implement its
interface; the optional schedules; tasks and trainers at the top. docs/architecture.md draws the same map."""

import ast
import pathlib

import async_rlhf

ROOT = pathlib.Path(async_rlhf.__file__).parent
LAYERS = [
    ["errors", "types"],
    ["config", "data", "losses", "weight_sync", "plan"],
    ["learner", "scoring", "generation.engine", "generation.serve", "generation.vllm_worker_extension"],
    ["pipeline"],
    ["generation.pool"],
    ["experimental"],
    ["tasks", "trainers"],
]


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the async_rlhf modules it imports (at module level or inside functions), package-relative."""
    known = {_module(p) for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        out = edges.setdefault(_module(path), set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("async_rlhf."):
                base = node.module[len("async_rlhf."):]
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name[len("async_rlhf."):] for a in node.names if a.name.startswith("async_rlhf.")]
            out.update(n for n in names if n in known)
    return edges


def _layer(module: str) -> int | None:
    best = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer_and_no_import_runs_up_a_layer():
    edges = _imports()
    unplaced = sorted(m for m in edges if m not in ("", "generation") and _layer(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/architecture.md): {unplaced}"
    upward = sorted(f"{src} -> {dst}" for src, dsts in edges.items() for dst in dsts
                    if _layer(src) is not None and _layer(dst) is not None and _layer(dst) > _layer(src))
    assert not upward, f"imports that run up a layer: {upward}"


def test_no_import_circle():
    edges = _imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dst in sorted(edges.get(module, ())):
            if state.get(dst) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(dst):] + [dst])}")
            if dst not in state:
                visit(dst, path + [dst])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
