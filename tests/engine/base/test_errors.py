"""One error base: every exception class the package defines for a problem its user can fix
derives from ``RedrafterError`` (and keeps the standard base it had, so ``except ValueError``
still catches what it caught); the CLI reports any of them as one line without listing them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import typer

from redrafter_mlx.cli.errors import FlagError, cli_errors, user_errors
from redrafter_mlx.engine.base.errors import ParamError, RedrafterError
from tests.support.paths import ROOT

PACKAGES = ("redrafter_mlx", "weights_convert", "tuning")

# Signals one part of the package sends another, never shown to a user as they are: each is
# caught and turned into something else (an HTTP status, a skipped shape).
INTERNAL = {
    "redrafter_mlx.serve.requests.QueueFull": "the server answers 429",
    "redrafter_mlx.serve.requests.ShuttingDown": "the server answers 503",
    "redrafter_mlx.serve.app.EngineFailure": "the server answers 500 or 503",
    "tuning.search.BudgetExhausted": "the search stops measuring",
    "redrafter_mlx.engine.verifier.lm_taps.Exited": "LmModel.run_to ends mlx-lm's forward there",
}

# The standard base each class kept beside RedrafterError (callers catch these).
KEPT = {
    "ParamError": ValueError,
    "ShapeError": ValueError,
    "ShapeTooLarge": ValueError,
    "CorruptFileError": ValueError,
    "PromptSetError": ValueError,
    "ShardError": ValueError,
    "ConfigError": ValueError,
    "TrainingDiverged": ValueError,
    "DataError": ValueError,
    "FlagError": ValueError,
    "BenchError": ValueError,
    "SessionInUse": RuntimeError,
    "SearchError": RuntimeError,
    "ProfileWriteError": OSError,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exception_classes() -> dict[str, type]:
    """Every exception class defined at the top of a module of the package, by dotted name
    (the modules that define a class are imported; ``__main__`` is not)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
            if not names:
                continue
            module = importlib.import_module(module_name(path))
            for name in names:
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found[f"{module.__name__}.{name}"] = cls
    return found


CLASSES = exception_classes()


def test_the_scan_sees_the_package_s_errors():
    names = {name.rpartition(".")[2] for name in CLASSES}
    assert {"LoadError", "ConversionError", "TuneError", "FlagError", "ProtocolError"} <= names
    assert set(INTERNAL) <= set(CLASSES), sorted(set(INTERNAL) - set(CLASSES))
    assert len(CLASSES) >= 24


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_user_facing_error_derives_from_the_base(name):
    cls = CLASSES[name]
    if name in INTERNAL:
        assert not issubclass(cls, RedrafterError), f"{name} is internal: {INTERNAL[name]}"
        return
    assert issubclass(cls, RedrafterError), (
        f"{name} derives from {[b.__name__ for b in cls.__mro__[1:]]}, not RedrafterError "
        "(engine/base/errors.py): a user-facing error needs the base, an internal signal a "
        "line in INTERNAL saying what it becomes"
    )


@pytest.mark.parametrize("name", sorted(KEPT))
def test_each_keeps_the_standard_base_it_had(name):
    (cls,) = [c for full, c in CLASSES.items() if full.rpartition(".")[2] == name]
    assert issubclass(cls, KEPT[name]), f"{name} is no longer a {KEPT[name].__name__}"


def test_the_cli_catches_the_base_not_a_list():
    assert RedrafterError in user_errors()
    assert all(not issubclass(c, RedrafterError) for c in user_errors() if c is not RedrafterError)


class NewError(RedrafterError):
    """An error class no list names."""


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (NewError("the fix is to do X"), 1, "error: the fix is to do X"),
        (FlagError("--beam-width must be >= 1"), 2, "error: --beam-width must be >= 1"),
        (ParamError("batch_size", "must be >= 1"), 2, "error: --batch-size: must be >= 1"),
        (RuntimeError("boom"), 1, "error: unexpected RuntimeError: boom"),
    ],
)
def test_one_line_and_its_exit_code(capsys, error, code, line):
    with pytest.raises(typer.Exit) as exit_info, cli_errors():
        raise error
    assert exit_info.value.exit_code == code
    assert capsys.readouterr().err.strip().startswith(line)
