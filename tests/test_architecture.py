"""The tree is the architecture: each part imports only the parts below it, and no module imports itself
back through others. Every import is read from the source (module level, inside functions, under
`TYPE_CHECKING`), so an import hidden from the interpreter's start-up still counts."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# the benchmarks' families (kvpool/benchmarks/<family>/), lowest first: each is a part of its own, and a family
# may import only the families before it (and itself); the benchmarks' top (the suite) runs them all
BENCHMARK_FAMILIES = ("benchmarks.measure", "benchmarks.device", "benchmarks.transfer", "benchmarks.policy",
                      "benchmarks.per_step", "benchmarks.serving")  # fmt: skip
_BELOW_OPS = {"core", "backends", "worker", "scheduler", "connector", "integrations", "testing"}
# part -> the parts it may import (itself included); see each part's __init__.py and docs/architecture.md
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "backends": {"core", "backends"},
    "worker": {"core", "backends", "worker"},
    "scheduler": {"core", "scheduler"},
    "connector": {"core", "backends", "worker", "scheduler", "connector"},
    "integrations": {"core", "backends", "worker", "scheduler", "connector", "integrations"},
    "testing": {"core", "backends", "testing"},
    "benchmarks.measure": {"core", "benchmarks.measure"},
    "benchmarks.device": {"core", "backends", "worker", "benchmarks.measure", "benchmarks.device"},
    "benchmarks.transfer": {"core", "backends", "worker", "benchmarks.measure", "benchmarks.transfer"},
    "benchmarks.policy": {"core", "backends", "benchmarks.measure", "benchmarks.policy"},
    "benchmarks.per_step": {*_BELOW_OPS, "benchmarks.measure", "benchmarks.per_step"},
    "benchmarks.serving": {
        *_BELOW_OPS, "benchmarks.measure", "benchmarks.per_step", "benchmarks.policy", "benchmarks.serving"
    },
    "benchmarks": {*_BELOW_OPS, *BENCHMARK_FAMILIES, "benchmarks"},
    "ops": {"api", *_BELOW_OPS, *BENCHMARK_FAMILIES, "benchmarks", "ops"},
    "api": {"core", "backends", "worker", "scheduler"},  # kvpool/__init__.py: the public names
}
# third-party packages only some parts may import directly: engines and pool clients stay at the edges
EXTERNAL_ONLY_IN: dict[str, set[str]] = {
    "vllm": {"integrations", "testing", "benchmarks.per_step", "benchmarks.serving", "kvpool.ops.demo"},
    "mooncake": {"kvpool.backends.mooncake.native"},
    "lmcache": {"benchmarks.serving"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(path): path for path in sorted((SRC / "kvpool").rglob("*.py"))}


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """Every module `module` names in an import (the submodule when `from pkg import sub` names one)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in MODULES else target), node.lineno


def _part(module: str) -> str:
    """`kvpool.worker.layout` -> `worker`; a benchmark family's module -> its family
    (`kvpool.benchmarks.serving.serve` -> `benchmarks.serving`); the benchmarks' own top -> `benchmarks`."""
    if module == "kvpool":
        return "api"
    names = module.split(".")
    if len(names) > 2 and names[1] == "benchmarks" and (SRC / "kvpool" / "benchmarks" / names[2]).is_dir():
        return f"benchmarks.{names[2]}"
    return names[1] if len(names) > 1 else module


def _kvpool_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        edges[module] = {target for target, _ in _imports(module) if target in MODULES and target != module}
    return edges


def test_every_module_belongs_to_a_part_with_a_stated_responsibility() -> None:
    parts = {_part(module) for module in MODULES}
    assert parts == set(ALLOWED), (parts - set(ALLOWED), set(ALLOWED) - parts)
    for part in parts - {"api"}:
        face = SRC / "kvpool" / Path(*part.split(".")) / "__init__.py"
        docstring = ast.get_docstring(ast.parse(face.read_text()))
        assert docstring, f"{face} says nothing of what the part is responsible for"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_the_parts_its_part_may_use(module: str) -> None:
    allowed = ALLOWED[_part(module)]
    wrong = [
        f"line {line}: {target} ({_part(target)})"
        for target, line in _imports(module)
        if target.partition(".")[0] == "kvpool" and target in MODULES and _part(target) not in allowed
    ]
    assert not wrong, f"{module} ({_part(module)}) may import only {sorted(allowed)}: {wrong}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_engines_and_pool_clients_are_imported_only_at_the_edges(module: str) -> None:
    wrong = []
    for target, line in _imports(module):
        places = EXTERNAL_ONLY_IN.get(target.partition(".")[0])
        if places is not None and _part(module) not in places and module not in places:
            wrong.append(f"line {line}: {target}, allowed only in {sorted(places)}")
    assert not wrong, f"{module}: {wrong}"


def test_every_benchmark_family_says_what_it_measures_and_imports_no_family_above_it() -> None:
    """Every folder of kvpool/benchmarks is a family in BENCHMARK_FAMILIES, with an `__init__.py` docstring;
    a family may import only the families before it, so imports between families go one way."""
    top = SRC / "kvpool" / "benchmarks"
    folders = {f"benchmarks.{path.name}" for path in top.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(BENCHMARK_FAMILIES), (folders - set(BENCHMARK_FAMILIES), set(BENCHMARK_FAMILIES) - folders)
    for rank, family in enumerate(BENCHMARK_FAMILIES):
        face = SRC / "kvpool" / Path(*family.split(".")) / "__init__.py"
        assert ast.get_docstring(ast.parse(face.read_text())), f"{face} says nothing of what the family measures"
        above = set(BENCHMARK_FAMILIES[rank + 1 :]) | {"benchmarks"}
        assert not ALLOWED[family] & above, f"{family} may import {sorted(ALLOWED[family] & above)}, above it"
    assert ALLOWED["benchmarks"] >= set(BENCHMARK_FAMILIES)  # the suite runs every family
    assert _part("kvpool.benchmarks.serving.serve") == "benchmarks.serving"
    assert _part("kvpool.benchmarks.suite") == _part("kvpool.benchmarks") == "benchmarks"


def test_no_module_imports_itself_back_through_others() -> None:
    edges = _kvpool_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


def test_the_rules_see_imports_hidden_in_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvpool.worker.stats import WorkerStats\n"
        "def f():\n    from kvpool.ops import cli\n"
    )
    MODULES["kvpool.core._probe"] = tmp_path / "probe.py"
    try:
        MODULES["kvpool.core._probe"].write_text(source)
        assert {target for target, _ in _imports("kvpool.core._probe")} >= {"kvpool.worker.stats", "kvpool.ops.cli"}
    finally:
        del MODULES["kvpool.core._probe"]
