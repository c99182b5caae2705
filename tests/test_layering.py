"""Imports run one way: drivers (ray_jobs/) -> actors (actors/) -> plain classes (eagle3/), and
compat/ at the bottom, the seams with vLLM, speculators and Ray Train.
Inside eagle3/, the stage folders run in pipeline order: prepare -> extract -> train -> evaluate.

Read from the source with `ast`, so an import inside a function (the lazy ones this codebase uses
to keep drivers light) counts as much as one at the top of a module, and nothing is imported.
When one of these fails: move the piece that both sides need down into the lower layer (as
compat/fp8.py, actors/replica_pool.py and eagle3.extract.manifest.resolve_files were), or pass it in.
"""

import ast

from tests.conftest import REPO

PACKAGES = ("compat", "actors", "eagle3", "ray_jobs")


def _module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of our packages -> the names it imports anywhere in its body: `import a.b`
    gives a.b; `from a.b import c` gives a.b and a.b.c (c may be a submodule)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            names = set()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{path}: relative import; this test reads absolute ones only"
                    names.add(node.module)
                    names |= {f"{node.module}.{alias.name}" for alias in node.names}
            found[_module_name(path)] = names
    return found


def _violations(imports: dict[str, set[str]], importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {name}" for module, names in imports.items()
                  if module == importer or module.startswith(importer + ".")
                  for name in names if name.split(".")[0] in forbidden)


def test_the_reader_sees_top_level_and_lazy_imports():
    """The checks below can only fail if the reader finds imports inside functions too."""
    imports = _imports()
    assert "compat.fp8.quantize_fp8" in imports["compat.hidden_states_connector"]  # top level
    assert "eagle3.train.data.vocab" in imports["eagle3.train.data.rows"]  # inside ShardRows.token_frequencies
    assert "actors.replica_pool" in imports["actors.online_feed"]  # inside OnlineFeed.start
    assert {"compat", "actors", "eagle3.train.data", "ray_jobs.extract"} <= set(imports)


def test_compat_imports_nothing_of_the_pipeline():
    found = _violations(_imports(), "compat", ("eagle3", "actors", "ray_jobs"))
    assert found == [], "compat/ runs back up (see this module's docstring for the fix):\n" + "\n".join(found)


def test_actors_import_no_driver():
    found = _violations(_imports(), "actors", ("ray_jobs",))
    assert found == [], "an actor imports a driver (see this module's docstring for the fix):\n" + "\n".join(found)


def test_eagle3_imports_no_actor_and_no_driver():
    found = _violations(_imports(), "eagle3", ("actors", "ray_jobs"))
    assert found == [], "eagle3/ runs back up (see this module's docstring for the fix):\n" + "\n".join(found)


STAGES = ("eagle3.prepare", "eagle3.extract", "eagle3.train", "eagle3.evaluate")  # eagle3/__init__.py


def _stage(name: str) -> int | None:
    """The position in STAGES of the stage a module belongs to; None for eagle3's shared top level."""
    return next((i for i, stage in enumerate(STAGES) if name == stage or name.startswith(stage + ".")), None)


def test_eagle3_stages_import_no_later_stage():
    """eagle3/'s stage folders follow the pipeline: a stage may import an earlier one (training reads
    prepare's held-out split and extract's shards), never a later one. The shared top level
    (config, schema, ...) may import any stage."""
    imports = _imports()
    assert "eagle3.prepare.heldout" in imports["eagle3.train.data.rows"]  # the reader sees cross-stage imports
    found = sorted(f"{module} imports {name}" for module, names in imports.items() for name in names
                   if _stage(module) is not None and _stage(name) is not None and _stage(name) > _stage(module))
    assert found == [], "an eagle3 stage imports a later one (move the shared piece to the earlier stage " \
                        "or to eagle3/'s top level):\n" + "\n".join(found)


def test_eagle3_modules_import_no_cycle():
    """No two eagle3 modules import each other, directly or around a longer loop (eagle3/train/data/rows.py
    and vocab.py did)."""
    imports = _imports()
    graph = {m: {n for n in names if n in imports and n != m} for m, names in imports.items()
             if m.startswith("eagle3")}
    cycles = []
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                loop = path + [module]
                cycles.append(" -> ".join(loop[loop.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == [], "eagle3 modules import each other:\n" + "\n".join(cycles)
