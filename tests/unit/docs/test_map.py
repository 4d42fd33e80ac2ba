"""docs/architecture.md is a map kept true by tests: its layer list is the one `tests/unit/test_layers.py` enforces,
its folder tree lists every module of the package, every file path that the docs or a docstring name exists, and the
core names none of the symbols only the optional schedules (`experimental/`) use."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PACKAGE = ROOT / "async_rlhf"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _layers_of_the_test() -> list[list[str]]:
    tree = ast.parse((ROOT / "tests" / "unit" / "test_layers.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LAYERS")
    return ast.literal_eval(node.value)


def test_the_maps_layer_list_is_the_one_the_import_test_enforces():
    start = ARCHITECTURE.index("The import layers, bottom up")
    drawn = []
    for line in ARCHITECTURE[start:].splitlines()[1:]:
        if re.match(r"^\d+\. `", line):
            drawn.append(re.findall(r"`([\w.]+)`", line))
        elif drawn:
            break
    assert drawn == _layers_of_the_test()


def _tree_entries() -> dict[str, set[str]]:
    """Folder (package-relative, '' for the root) -> the words of its entry in the map's folder tree."""
    block = ARCHITECTURE[ARCHITECTURE.index("```\nasync_rlhf/\n") + len("```\nasync_rlhf/\n"):]
    block = block[:block.index("```")]
    entries: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        head = line[2:].split(" ")[0] if line.startswith("  ") and not line.startswith("   ") else None
        if head is not None:
            current = head.rstrip("/") if head.endswith("/") else ""
            words = line[2:] if current == "" else line[2 + len(head):]
            entries.setdefault(current, set()).update(re.findall(r"[\w]+", words.replace(".py", "")))
        elif current is not None:
            entries[current].update(re.findall(r"[\w]+", line))
    return entries


def test_the_maps_folder_tree_lists_every_module_of_the_package():
    entries = _tree_entries()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" or rel.parts[0] == "__pycache__":
            continue
        folder = rel.parent.as_posix() if rel.parent.as_posix() != "." else ""
        if rel.stem not in entries.get(folder, set()):
            missing.append(rel.as_posix())
    assert not missing, f"modules the map's folder tree (docs/architecture.md) does not list: {missing}"


# files that runs write (named in docs as outputs), not files of the repository
OUTPUTS = {"config.yaml", "gpu_kit.md"}
EXTERNAL = ("vllm/", "trl/", "transformers/", "torch/", "accelerate/", "deepspeed/")
PATH = re.compile(r"`([A-Za-z0-9_./-]*?[A-Za-z0-9_]\.(?:py|md|yaml|sh))(?:::[\w\[\]-]+)?`")


def _repo_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if (ROOT / f).exists()]


def _texts(files: list[str]):
    """(file, text) of every doc page and every docstring of the repository's Python files."""
    for f in files:
        if f == "README.md" or (f.startswith("docs/") and f.endswith(".md")):
            yield f, (ROOT / f).read_text()
        elif f.endswith(".py"):
            tree = ast.parse((ROOT / f).read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield f, doc


def _external_exists(path: str) -> bool:
    import importlib.util

    package = path.split("/")[0]
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None and (pathlib.Path(spec.origin).parent.parent / path).exists()


def test_every_file_path_the_docs_and_docstrings_name_exists():
    files = _repo_files()
    missing = {}
    for source, text in _texts(files):
        for match in PATH.finditer(text):
            name = match.group(1).removeprefix("./")
            if name in OUTPUTS or any(f == name or f.endswith("/" + name) for f in files):
                continue
            if name.startswith(EXTERNAL) and _external_exists(name):
                continue
            missing.setdefault(name, []).append(source)
    assert not missing, f"paths named in docs or docstrings that do not exist (path: where): {missing}"


# Names (config options, messages, hooks) that only the optional schedules use. The core must not name them in code
# (docstrings may say where they live): it reaches a schedule only through the seams it declares. vLLM's own names
# (`speculative_config`, its `spec_decode` counters) are a pass-through and not listed.
EXPERIMENTAL_SYMBOLS = {
    "partial_rollouts", "train_while_generating", "tail_migration", "generator_autoscale",
    "generator_autoscale_devices", "generator_autoscale_cost", "generator_autoscale_window",
    "generator_autoscale_wait", "generator_autoscale_idle", "reference_while_generating", "staleness_bound",
    "max_oldest_staleness", "TailHandoff", "Migrated", "ContinuedRequest", "HandoffEngine", "TailMigration",
    "PartialBatches", "ArrivalOrderBatches", "ElasticGenerators", "reference_parts", "prefixes", "origins",
    "ref_logprobs", "add_generator", "retire_generator", "advance_retiring", "ElasticGeneratorPool",
    "speculative", "num_speculative_tokens", "resolve_speculative", "HistoryProposer",
    "continuous_batching", "continuous_batching_config", "ContinuousBatchingBackend", "ContinuousBatchingEngine",
    "CONTINUOUS_BATCHING_FORCED",
}
CORE = ["pipeline", "generation", "trainers", "types.py", "config/base.py"]
# Names of earlier versions' files, which the core reads into today's fields (checkpoints outlive the code): the
# strings of a module-level `RETIRED_FIELDS` table are the only place the core may write them.
RETIRED = "RETIRED_FIELDS"


def _named(path: pathlib.Path) -> set[str]:
    """Identifiers `path` uses in code: names, attributes, definitions, arguments, and strings that are identifiers
    (not docstrings)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    retired = {id(c) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
               and RETIRED in [getattr(t, "id", "") for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
               for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.keyword, ast.arg)) and n.arg:
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings | retired:
            out.add(n.value)
    return out


def test_the_core_names_no_symbol_of_the_optional_schedules():
    found = {}
    for entry in CORE:
        paths = [PACKAGE / entry] if entry.endswith(".py") else sorted((PACKAGE / entry).rglob("*.py"))
        for path in paths:
            names = _named(path) & EXPERIMENTAL_SYMBOLS
            if names:
                found[path.relative_to(PACKAGE).as_posix()] = names
    assert not found, f"the core names experimental symbols (reach the schedule through a seam instead): {found}"
