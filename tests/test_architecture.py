"""The layers' dependency rule, checked by parsing every module's imports with ``ast``.

Layers, lowest first: ``redrafter_mlx.engine`` -> ``redrafter_mlx.measure`` (the measuring tools
over the engine) -> (``redrafter_mlx.train``, ``redrafter_mlx.serve``, ``tuning``,
``weights_convert``) -> ``redrafter_mlx.cli``. A module may import its own layer or lower ones,
never a higher one; nothing imports the CLI; features do not import each other; the build
scripts and tests sit outside the product and nothing in it imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("redrafter_mlx", "weights_convert", "tuning")
ENGINE = "engine"
MEASURE = "measure"  # bench's and the tuner's measuring tools: above the engine, below features
CLI = "cli"
OUTSIDE = "outside"  # scripts/ and tests/: may import anything, imported by nothing


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] in ("scripts", "tests"):
        return OUTSIDE
    if parts[0] == "redrafter_mlx":
        if len(parts) == 1:  # the package's lazy public API re-exports the engine
            return ENGINE
        named = {"engine": ENGINE, "measure": MEASURE, "cli": CLI}
        return named.get(parts[1], f"redrafter_mlx.{parts[1]}")
    return parts[0]  # tuning, weights_convert: feature packages


def allowed(importer: str, imported: str) -> bool:
    """Whether a module of layer ``importer`` may import one of layer ``imported``."""
    if importer == imported or imported == ENGINE:
        return True
    if imported == MEASURE:
        return importer != ENGINE
    if imported in (CLI, OUTSIDE):
        return importer in (CLI, OUTSIDE) and (imported != OUTSIDE or importer == OUTSIDE)
    return importer in (CLI, OUTSIDE)  # a feature package: only the CLI and scripts use it


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_nodes(tree: ast.AST, module_level: bool):
    """Every import statement, or (``module_level``) those that run when the module is imported:
    not inside a function, nor under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if module_level and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for branch in node.orelse:
                yield from _import_nodes(ast.Module([branch], []), module_level)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_nodes(node, module_level)


def imports_of(
    path: Path, root: Path = ROOT, module_level: bool = False, names: bool = False
) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in the file, relative ones resolved.

    ``names``: also ``module.name`` for each ``from module import name`` (it may be a module).
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8")), module_level):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
            continue
        target = _resolve(package, node)
        found.append((node.lineno, target))
        if names or node.module is None or node.level:  # "from . import x": x may be a module
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def all_files(root: Path = ROOT) -> list[Path]:
    """The product, the build scripts and the tests."""
    outside = [p for d in ("scripts", "tests") for p in (root / d).rglob("*.py")]
    return product_files(root) + sorted(outside)


def upward_imports(path: Path, root: Path = ROOT) -> list[str]:
    """This file's imports of a layer above its own (empty when it keeps the rule)."""
    importer = layer_of(module_name(path, root))
    return [
        f"line {line}: {module} ({layer_of(module)})"
        for line, module in imports_of(path, root)
        if ours(module) and not allowed(importer, layer_of(module))
    ]


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules among ``files`` it imports when it is imported (module level)."""
    modules = {module_name(p, root): p for p in files}
    return {
        name: {m for _, m in imports_of(path, root, True, True) if m in modules and m != name}
        for name, path in modules.items()
    }


def dependency_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules among ``files`` it imports anywhere: at module level, inside a
    function, under ``TYPE_CHECKING``. ``from package import submodule`` depends on the
    submodule, not on the package's ``__init__`` (which any submodule import runs), so a
    package whose function imports a submodule that imports its siblings is no circle."""
    modules = {module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8")), False):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
                continue
            target = _resolve(package, node)
            named = {f"{target}.{alias.name}" for alias in node.names}
            found |= named & set(modules) if named <= set(modules) else {target, *named}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _resolve(package: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement names."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as [a, b, ..., a], or None when there is none."""
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            circle = visit(nxt, [*trail, node])
            if circle:
                return circle
        done.add(node)
        return None

    for node in sorted(graph):
        circle = visit(node, [])
        if circle:
            return circle
    return None


def ours(module: str) -> bool:
    return module.split(".")[0] in (*PACKAGES, "scripts", "tests")


def test_the_layers_are_folders():
    engine = {p.stem for p in (ROOT / "redrafter_mlx" / "engine").rglob("*.py")}
    assert {"lm_model", "drafter", "tree", "sampling", "decode", "generation", "loading"} <= engine
    assert not engine & {"model", "rope"}, "one verifier: mlx-lm's model (lm_model.py)"
    flat = {p.name for p in (ROOT / "redrafter_mlx" / "engine").glob("*.py")}
    assert flat == {"__init__.py"}, f"engine modules outside a sub-package: {sorted(flat)}"
    assert not engine & {"measure", "profile", "throughput"}, "measuring tools live in measure/"
    assert {"throughput", "profile", "verify_cost"} <= {
        p.stem for p in (ROOT / "redrafter_mlx" / "measure").glob("*.py")
    }
    assert (ROOT / "redrafter_mlx" / "cli" / "__init__.py").is_file()
    assert (ROOT / "redrafter_mlx" / "train" / "distill.py").is_file()
    top = {p.name for p in (ROOT / "redrafter_mlx").glob("*.py")}
    assert top == {"__init__.py"}, f"modules outside a layer folder: {sorted(top)}"


def test_the_design_map_names_every_folder():
    """docs/design.md's table of folders lists every code folder, and only existing ones."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    mapped = {
        line.split("`")[1].rstrip("/") for line in text.splitlines() if line.startswith("| `")
    }
    code = {"scripts", "tests", *PACKAGES}
    code |= {
        f"redrafter_mlx/{p.parent.name}" for p in (ROOT / "redrafter_mlx").glob("*/__init__.py")
    }
    code |= {f"redrafter_mlx/engine/{p.parent.name}" for p in ENGINE_DIR.glob("*/__init__.py")}
    assert mapped == code - {"redrafter_mlx"}


@pytest.mark.parametrize("path", product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    wrong = upward_imports(path)
    importer = layer_of(module_name(path))
    assert not wrong, f"{path.relative_to(ROOT)} ({importer}) imports upward: {wrong}"


# The engine's sub-packages, lowest first: each imports its own or a lower one, never a higher
# one, at module level or inside a function (docs/design.md, "The engine's map").
ENGINE_LAYERS = ("base", "core", "verifier", "drafting", "decoding", "loop")
ENGINE_DIR = ROOT / "redrafter_mlx" / "engine"


def engine_layer(module: str) -> int | None:
    """The rank of an engine module's sub-package in ``ENGINE_LAYERS`` (None: not one)."""
    parts = module.split(".")
    if parts[:2] != ["redrafter_mlx", "engine"] or len(parts) < 3:
        return None
    return ENGINE_LAYERS.index(parts[2]) if parts[2] in ENGINE_LAYERS else None


def engine_upward(path: Path, root: Path = ROOT) -> list[str]:
    """This engine file's imports of a higher engine sub-package (empty when it keeps the rule)."""
    own = engine_layer(module_name(path, root))
    return [
        f"line {line}: {module}"
        for line, module in imports_of(path, root)
        if own is not None and (engine_layer(module) or 0) > own
    ]


def test_the_engine_sub_packages_are_the_map():
    found = {p.parent.name for p in ENGINE_DIR.glob("*/__init__.py")}
    assert found == set(ENGINE_LAYERS)


@pytest.mark.parametrize(
    "path", sorted(ENGINE_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(ENGINE_DIR))
)
def test_engine_imports_point_down_its_sub_packages(path):
    wrong = engine_upward(path)
    assert not wrong, f"{path.relative_to(ROOT)} imports a higher engine sub-package: {wrong}"


def test_the_engine_checker_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: a drafting module importing the loop, inside a function, is
    flagged; one importing the core is not."""
    _write(
        tmp_path,
        {
            "redrafter_mlx/__init__.py": "",
            "redrafter_mlx/engine/__init__.py": "",
            "redrafter_mlx/engine/drafting/__init__.py": "",
            "redrafter_mlx/engine/drafting/a.py": "from ..core import tree\n"
            "def f():\n    from ..loop import batch\n",
        },
    )
    wrong = engine_upward(tmp_path / "redrafter_mlx/engine/drafting/a.py", tmp_path)
    assert wrong and all("line 3: redrafter_mlx.engine.loop" in w for w in wrong)


def test_no_import_circle_anywhere():
    """No module-level import circle between any two modules: product, scripts or tests."""
    circle = find_circle(import_graph(all_files()))
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_no_import_circle_even_inside_functions():
    """No circle between modules of the product or the scripts, counting every import (one
    inside a function or under ``TYPE_CHECKING`` too): a module that another one's function
    imports does not import it back, so the shared piece lives below both."""
    files = product_files() + sorted((ROOT / "scripts").rglob("*.py"))
    circle = find_circle(dependency_graph(files))
    assert circle is None, f"import circle: {' -> '.join(circle)}"


@pytest.mark.parametrize(
    "path",
    product_files() + sorted((ROOT / "scripts").rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_star_import(path):
    """Every name a module uses is imported from the module that defines it: no
    ``from module import *`` (a re-export that hides where a name lives)."""
    stars = [
        f"line {node.lineno}: from {node.module} import *"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
    ]
    assert not stars, f"{path.relative_to(ROOT)}: {stars}"


CLI_DIR = ROOT / "redrafter_mlx" / "cli"
COMMAND_LINES = 80  # the longest a command function may be, its decorators and signature counted
FILE_LINES = 600  # the longest a module of the package may be
LONG_FILES: dict[str, str] = {}  # modules still over FILE_LINES, and why


def command_functions() -> dict[str, ast.FunctionDef]:
    """Each command of the CLI (``cli.COMMANDS``) by name: the function of that name in its
    module."""
    tree = ast.parse((CLI_DIR / "__init__.py").read_text(encoding="utf-8"))
    (names,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "COMMANDS"
    ]
    found = {}
    for name in names:
        module = ast.parse((CLI_DIR / f"{name}.py").read_text(encoding="utf-8"))
        found[name] = next(n for n in module.body if getattr(n, "name", None) == name)
    return found


@pytest.mark.parametrize("name", sorted(command_functions()))
def test_a_command_reads_its_options_from_one_flag_group(name):
    """A command function takes one parameter, a flag group (``cli/options.py``'s
    ``flag_groups``), and is short: its work is in functions of their own."""
    function = command_functions()[name]
    params = function.args.args + function.args.kwonlyargs
    annotation = ast.unparse(params[0].annotation) if len(params) == 1 else None
    assert annotation is not None and annotation.endswith("Flags"), (
        f"{name}() takes {[ast.unparse(p) for p in params]}: one flag group, e.g. "
        f"{name.capitalize()}Flags"
    )
    decorators = [ast.unparse(d) for d in function.decorator_list]
    assert "flag_groups" in decorators or "sampling_options" in decorators, decorators
    start = min([d.lineno for d in function.decorator_list] + [function.lineno])
    length = function.end_lineno - start + 1
    assert length <= COMMAND_LINES, f"{name}() is {length} lines (at most {COMMAND_LINES})"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "redrafter_mlx").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_module_of_the_package_is_over_600_lines(path):
    rel = str(path.relative_to(ROOT))
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if rel in LONG_FILES:
        assert lines > FILE_LINES, f"{rel} is {lines} lines now: drop it from LONG_FILES"
        return
    assert lines <= FILE_LINES, f"{rel} is {lines} lines (at most {FILE_LINES}): split it"


def test_no_cycle_between_packages():
    """Package-level graph (engine, train, tuning, weights_convert, cli, ...) has no cycle."""
    graph: dict[str, set[str]] = {}
    for path in product_files():
        src = layer_of(module_name(path))
        for _, module in imports_of(path):
            if ours(module) and layer_of(module) != src:
                graph.setdefault(src, set()).add(layer_of(module))

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, f"import cycle: {' -> '.join((*trail, node))}"
        for nxt in graph.get(node, ()):
            visit(nxt, (*trail, node))

    for node in list(graph):
        visit(node, ())


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    """On a synthetic tree: a module-level circle (through a package and a relative import)
    and an engine module importing the CLI are caught; an import inside a function, under
    TYPE_CHECKING, or pointing down is not."""
    _write(
        tmp_path,
        {
            "redrafter_mlx/__init__.py": "",
            "redrafter_mlx/engine/__init__.py": "",
            "redrafter_mlx/engine/a.py": "from redrafter_mlx.engine import b\n",
            "redrafter_mlx/engine/b.py": "import redrafter_mlx.engine.c\n",
            "redrafter_mlx/engine/c.py": "from .a import thing\n",
            "redrafter_mlx/engine/d.py": "def f():\n    from redrafter_mlx.engine import e\n",
            "redrafter_mlx/engine/e.py": (
                "from typing import TYPE_CHECKING\n"
                "from redrafter_mlx.engine import d\n"
                "if TYPE_CHECKING:\n    from redrafter_mlx.cli import x\n"
            ),
            "redrafter_mlx/engine/up.py": "def f():\n    from redrafter_mlx.cli.common import x\n",
            "redrafter_mlx/cli/__init__.py": "",
            "redrafter_mlx/cli/common.py": "from redrafter_mlx.engine import up\n",
            "tuning/__init__.py": "",
            "weights_convert/__init__.py": "",
        },
    )
    graph = import_graph(all_files(tmp_path), tmp_path)
    circle = find_circle(graph)
    assert circle is not None and circle[0] == circle[-1]
    assert set(circle) == {
        "redrafter_mlx.engine.a",
        "redrafter_mlx.engine.b",
        "redrafter_mlx.engine.c",
    }
    del graph["redrafter_mlx.engine.c"]  # d <-> e meets only inside a function: no circle
    assert find_circle(graph) is None
    deps = dependency_graph(all_files(tmp_path), tmp_path)  # every import counted: two more
    del deps["redrafter_mlx.engine.c"]
    assert set(find_circle(deps)) == {"redrafter_mlx.cli.common", "redrafter_mlx.engine.up"}
    del deps["redrafter_mlx.engine.up"]
    assert set(find_circle(deps)) == {"redrafter_mlx.engine.d", "redrafter_mlx.engine.e"}
    up = tmp_path / "redrafter_mlx" / "engine" / "up.py"
    assert upward_imports(up, tmp_path) == ["line 2: redrafter_mlx.cli.common (cli)"]
    down = tmp_path / "redrafter_mlx" / "cli" / "common.py"
    assert upward_imports(down, tmp_path) == []


def test_a_package_importing_its_submodule_lazily_is_no_circle(tmp_path):
    """A package's function imports a submodule that imports its siblings through the
    package (``from pkg import sibling``): no circle; one that imports a name the package's
    ``__init__`` defines is one."""
    _write(
        tmp_path,
        {
            "weights_convert/__init__.py": "def convert():\n    from weights_convert import run\n",
            "weights_convert/run.py": "from weights_convert import part\n",
            "weights_convert/part.py": "",
            "tuning/__init__.py": "def tune():\n    from tuning import run\n",
            "tuning/run.py": "from tuning import tune\n",
        },
    )
    circle = find_circle(dependency_graph(all_files(tmp_path), tmp_path))
    assert circle is not None and set(circle) == {"tuning", "tuning.run"}


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: an engine module importing the CLI is flagged."""
    assert not allowed(
        layer_of("redrafter_mlx.engine.decoding.decode"), layer_of("redrafter_mlx.cli")
    )
    assert not allowed(layer_of("tuning.search"), layer_of("redrafter_mlx.cli.common"))
    assert not allowed(layer_of("weights_convert.sources"), layer_of("tuning"))
    assert allowed(layer_of("tuning.search"), layer_of("redrafter_mlx.engine.core.shape"))
    assert not allowed(
        layer_of("redrafter_mlx.engine.verifier.lm_model"), layer_of("scripts.build_demo")
    )
    assert not allowed(
        layer_of("redrafter_mlx.engine.loop.generation"), layer_of("redrafter_mlx.measure")
    )
    assert allowed(layer_of("tuning.measure"), layer_of("redrafter_mlx.measure.throughput"))
    assert allowed(layer_of("redrafter_mlx.cli.bench"), layer_of("redrafter_mlx.measure.profile"))
    assert not allowed(layer_of("redrafter_mlx.measure.profile"), layer_of("tuning.search"))
