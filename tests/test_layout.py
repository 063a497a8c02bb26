"""The test suite's own layout, checked by reading its files (issue 65, item 6).

* Each folder of ``tests/`` mirrors a package: ``tests/engine/loop/`` tests
  ``redrafter_mlx/engine/loop/``, ``tests/convert/`` the converter (``weights_convert``),
  ``tests/tuning/`` the tuner; ``support/`` (shared helpers) and ``fixtures/`` (committed data)
  are the only other folders. Every folder is a package (``__init__.py``), so two folders may
  hold files of the same name.
* No test module imports another: what several share lives in ``tests/support/`` (helpers) or a
  ``conftest.py`` (fixtures), and a test module imports only those.
* No test file is named by a round of work (``test_bad_inputs_4.py``): a name says what it tests.
* At the top of ``tests/`` sit only the checks of the whole repository (``WHOLE_REPOSITORY``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import ROOT

SHARED = ("support", "fixtures")  # folders that hold no tests of their own
PACKAGE_OF = {"convert": "weights_convert"}  # a test folder named for what its package does
WHOLE_REPOSITORY = {"test_architecture.py", "test_layout.py"}  # may sit at the top of tests/
ROUND = re.compile(r"(_\d+$)|round", re.IGNORECASE)  # test_bad_inputs_4, test_round3_...


def package_for(folder: Path, tests: Path, root: Path) -> Path | None:
    """The package folder a test folder mirrors, or None when there is none."""
    first, *rest = folder.relative_to(tests).parts
    top = PACKAGE_OF.get(first, first)
    for base in (root / "redrafter_mlx" / top, root / top):
        if base.is_dir():
            code = base.joinpath(*rest)
            return code if code.is_dir() else None
    return None


def imported_tests(path: Path) -> list[str]:
    """The modules of ``tests`` outside ``tests.support`` that ``path`` imports (relative
    imports included: ``from .test_x import y`` names another test module too)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            bad.append("." * node.level + (node.module or ""))
            continue
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if node.module == "tests":
                names = [f"tests.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" and parts[1:2] != ["support"]:
                bad.append(name)
    return bad


def layout_problems(root: Path) -> list[str]:
    """Every way the ``tests/`` folder under ``root`` breaks the rules above, one line each."""
    tests = root / "tests"
    problems = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()):
        rel = folder.relative_to(tests)
        if rel.parts[0] in SHARED[1:] or any(p.startswith((".", "__")) for p in rel.parts):
            continue
        if not (folder / "__init__.py").exists():
            problems.append(f"tests/{rel.as_posix()} has no __init__.py: add an empty one")
        if rel.parts[0] not in SHARED and package_for(folder, tests, root) is None:
            problems.append(
                f"tests/{rel.as_posix()} names no package: name test folders after the code "
                "they test (redrafter_mlx/<layer>/..., weights_convert as convert, tuning)"
            )
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == "fixtures":
            continue
        where = f"tests/{rel.as_posix()}"
        if path.name.startswith("test_"):
            if ROUND.search(path.stem):
                problems.append(f"{where} is named by a round: name it after what it tests")
            if len(rel.parts) == 1 and path.name not in WHOLE_REPOSITORY:
                problems.append(f"{where} sits at the top: move it to the folder of its code")
            if rel.parts[0] in SHARED:
                problems.append(
                    f"{where} is a test in {rel.parts[0]}/: move it to its code's folder"
                )
        for name in imported_tests(path):
            problems.append(
                f"{where} imports {name}: move what it shares to tests/support/ (fixtures to "
                "a conftest.py)"
            )
    return problems


def test_the_suite_mirrors_the_packages():
    assert layout_problems(ROOT) == []


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_test_module_importing_another_is_named(tmp_path):
    root = write(
        tmp_path,
        {
            "redrafter_mlx/serve/__init__.py": "",
            "tests/__init__.py": "",
            "tests/serve/__init__.py": "",
            "tests/serve/test_a.py": "from tests.serve.test_b import helper\n",
            "tests/serve/test_b.py": "def f():\n    from .test_a import x\n",
            "tests/serve/test_c.py": "from tests.support.models import tiny_model\n",
            "tests/serve/test_d.py": "from tests import conftest\n",
        },
    )
    problems = layout_problems(root)
    assert len(problems) == 3, problems
    assert "tests/serve/test_a.py imports tests.serve.test_b" in problems[0]
    assert "tests/serve/test_b.py imports .test_a" in problems[1]
    assert "tests/serve/test_d.py imports tests.conftest" in problems[2]


def test_a_round_name_a_stray_folder_and_a_top_level_test_are_named(tmp_path):
    root = write(
        tmp_path,
        {
            "redrafter_mlx/engine/loop/__init__.py": "",
            "weights_convert/__init__.py": "",
            "tests/__init__.py": "",
            "tests/test_loop_things.py": "",
            "tests/engine/__init__.py": "",
            "tests/engine/loop/__init__.py": "",
            "tests/engine/loop/test_bad_inputs_5.py": "",
            "tests/engine/loop/test_rows.py": "",
            "tests/engine/heads/test_heads.py": "",
            "tests/convert/__init__.py": "",
            "tests/convert/test_gguf.py": "",
            "tests/misc/__init__.py": "",
        },
    )
    problems = layout_problems(root)
    assert len(problems) == 5, problems
    assert problems[0] == "tests/engine/heads has no __init__.py: add an empty one"
    assert problems[1].startswith("tests/engine/heads names no package")
    assert problems[2].startswith("tests/misc names no package")
    assert problems[3].startswith("tests/engine/loop/test_bad_inputs_5.py is named by a round")
    assert problems[4].startswith("tests/test_loop_things.py sits at the top")
