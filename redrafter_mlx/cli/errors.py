"""The one error path of every command: a bad flag (``FlagError``) or a ``ParamError`` is one
red ``error:`` line naming the flag and exit code 2; any problem the user can fix (the
package's ``RedrafterError``, a bad value, a file) one line and exit code 1; Ctrl-C exit code
130; anything else is a bug, still one line. ``--verbose`` adds the traceback."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import typer

from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.engine.base.errors import ParamError, RedrafterError


class FlagError(RedrafterError, ValueError):
    """A bad command-line value: reported as one line with exit code 2."""


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` in red on stderr; return the typer.Exit to raise."""
    from rich.text import Text

    err_console().print(Text(f"error: {message}", style="bold red"))
    return typer.Exit(code=code)


FLAG_NAMES = {"temperature": "--temp", "width": "--beam-width", "length": "--beam-length"}


def flag_for(param: str) -> str:
    """The command-line flag of an engine/feature parameter (``batch_size`` -> ``--batch-size``)."""
    return FLAG_NAMES.get(param, "--" + param.replace("_", "-"))


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a problem the user can fix (one line, exit code 1): every error
    of the package's own (``RedrafterError``: load, convert, tune, data, prompt sets...) and
    the standard kinds that a bad value or a file the user named raise, in our code and in the
    libraries under it (``ValueError``, ``OSError``)."""
    return (RedrafterError, ValueError, OSError)


@contextlib.contextmanager
def cli_errors(verbose: bool = False, interrupted: str = "interrupted") -> Iterator[None]:
    """The one error path of every command: one red ``error:`` line and an exit code.

    FlagError and engine ParamError (named by its flag) -> 2; user errors (``user_errors``)
    -> 1; Ctrl-C -> 130 with ``interrupted``; anything else is a bug, still one line.
    ``--verbose`` adds the traceback. typer's own exits pass through.
    """
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except FlagError as e:
        _maybe_traceback(verbose)
        raise fail(str(e), code=2) from None
    except ParamError as e:
        _maybe_traceback(verbose)
        flag = flag_for(e.param)  # named once: a message that starts with it stands alone
        said = e.message if e.message.startswith(flag + " ") else f"{flag}: {e.message}"
        raise fail(said, code=2) from None
    except KeyboardInterrupt:
        _maybe_traceback(verbose)
        raise fail(interrupted, code=130) from None
    except Exception as e:
        _maybe_traceback(verbose)
        if isinstance(e, user_errors()):
            raise fail(str(e)) from None
        hint = "" if verbose else " (run with --verbose for the traceback)"
        raise fail(f"unexpected {type(e).__name__}: {e}{hint}") from None


def _maybe_traceback(verbose: bool) -> None:
    """Print the current exception's traceback on stderr when --verbose is on."""
    if verbose:
        traceback.print_exc(file=sys.stderr)


def one_line_warnings() -> None:
    """Python warnings (a narrowed beam's note, a library's ``UserWarning``) show as one
    ``warning:`` line on stderr, without the source path and line Python adds; transformers'
    own log warnings ("You are using a model of type X to instantiate...") are silenced."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        first = (str(message).strip().splitlines() or [category.__name__])[0]
        print(f"warning: {first}", file=file or sys.stderr)

    warnings.showwarning = show
