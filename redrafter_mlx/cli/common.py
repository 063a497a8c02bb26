"""Shared pieces of the chat / generate / bench commands.

* typer option types (``--model``, ``--drafter``, sampling and beam flags) so every command
  spells them the same way, following ``mlx_lm.generate`` / ``mlx_lm.chat``;
* flag validation (a bad value is one red line and exit code 2);
* model resolution (``--model``, else the bundled demo model) and loading;
* the beam shape: explicit flags, else the tuned profile or chip preset;
* ``prepare_engine``: those steps, in one order, for chat, generate, serve and bench;
* error handling: one red ``error:`` line on stderr and exit code 1, a traceback only
  with ``--verbose``;
* the dim one-line stats summary printed after an answer.

Only typer and the standard library are imported at module level so ``--help`` is fast.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from redrafter_mlx.engine.sampling import SamplerConfig
    from redrafter_mlx.engine.shape import BeamShape
    from tuning import ShapeChoice

# --------------------------------------------------------------------------- option types

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="MLX model directory, Hugging Face repo id, or a bundled model: smollm2 "
        "(installed by make install) or demo (default: smollm2 when installed with its "
        "drafter, else demo).",
        show_default=False,
    ),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter",
        "-d",
        help="ReDrafter drafter directory trained for --model (default: the model's own "
        "drafter: OUT/drafter of a conversion, the bundled one for the demo; else none, "
        "plain decoding).",
        show_default=False,
    ),
]
TempOpt = Annotated[
    float | None,
    typer.Option(
        "--temp",
        help="Sampling temperature, 0 = greedy (default: the model's generation_config.json "
        "value in chat and generate, else 0; bench: 0).",
        show_default=False,
    ),
]
TopPOpt = Annotated[
    float | None,
    typer.Option(
        "--top-p",
        help="Nucleus sampling mass in (0, 1] (default: the model's in chat and generate, else 1).",
        show_default=False,
    ),
]
TopKOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        help="Keep only the k most likely tokens, 0 = off (default: the model's in chat and "
        "generate, else 0).",
        show_default=False,
    ),
]
MinPOpt = Annotated[
    float | None,
    typer.Option(
        "--min-p",
        help="Drop tokens below min_p x the top probability (default: the model's in chat and "
        "generate, else 0).",
        show_default=False,
    ),
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", help="Random seed for sampling, in [0, 2**64 - 1].")
]
RepetitionPenaltyOpt = Annotated[
    float | None,
    typer.Option(
        "--repetition-penalty",
        help="Penalise tokens seen in the last --repetition-context-size tokens: positive "
        "logits divided by it, negative multiplied (> 1 discourages repeats; 1 = off; "
        "default: the model's in chat and generate, else off).",
        show_default=False,
    ),
]
RepetitionContextOpt = Annotated[
    int,
    typer.Option(
        "--repetition-context-size", help="Tokens the repetition penalty looks back over."
    ),
]
LogitBiasOpt = Annotated[
    str | None,
    typer.Option(
        "--logit-bias",
        help='Add to token logits: "ID:BIAS,ID:BIAS" or a JSON object {"ID": BIAS} '
        "(-100 all but bans a token).",
        show_default=False,
    ),
]
MaxKvSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--max-kv-size",
        help="Most tokens the KV cache holds per conversation (memory bound): an answer "
        "stops there and chat drops its oldest turns to fit (default: the model's context).",
        show_default=False,
    ),
]
MIN_KV_SIZE = 64
SystemPromptOpt = Annotated[
    str | None,
    typer.Option(
        "--system-prompt",
        help="System prompt (default: Vicuna's, or the chat template's).",
        show_default=False,
    ),
]
BeamWidthOpt = Annotated[
    int | None,
    typer.Option(
        "--beam-width",
        help="Beams drafted per step (default: tuned profile or chip preset).",
        show_default=False,
    ),
]
BeamLengthOpt = Annotated[
    int | None,
    typer.Option(
        "--beam-length",
        help="Tokens per beam, counting the init token (>= 2) "
        "(default: tuned profile or chip preset).",
        show_default=False,
    ),
]
CapacityOpt = Annotated[
    int | None,
    typer.Option(
        "--capacity",
        help="Packed tree slots verified per step, in [L, W*L] "
        "(default: W*(L-1)+1, or the tuned value).",
        show_default=False,
    ),
]
NoDraftOpt = Annotated[
    bool,
    typer.Option(
        "--no-draft", help="Decode autoregressively (the baseline) through the same engine."
    ),
]
LookupOpt = Annotated[
    int | None,
    typer.Option(
        "--lookup",
        help="Context-lookup chains per step: continuations of earlier matches of the text's "
        "last tokens, verified beside the drafter's beams (0 = off; default 1). A model "
        "without a drafter speculates with them alone.",
        show_default=False,
    ),
]
LookupLengthOpt = Annotated[
    int | None,
    typer.Option(
        "--lookup-length",
        help="Tokens per lookup chain, counting the init token (>= 2; default 8).",
        show_default=False,
    ),
]
NoLookupOpt = Annotated[
    bool,
    typer.Option("--no-lookup", help="No context-lookup chains (same as --lookup 0)."),
]
NoAdaptOpt = Annotated[
    bool,
    typer.Option(
        "--no-adapt",
        help="Pin the beam shape. By default the loop switches between it, the single "
        "beams of each length up to it and plain decoding, whichever gives the most "
        "tokens/s as measured.",
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float16, bfloat16 or float32 (default: float16 on Metal, float32 on CPU).",
        show_default=False,
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors.")]

DTYPES = ("float16", "bfloat16", "float32")


# --------------------------------------------------------------------------- errors


class FlagError(ValueError):
    """A bad command-line value: reported as one line with exit code 2."""


def err_console():
    """A rich console on stderr (errors, stats, notes)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console():
    """A rich console on stdout (answers and tables)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


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
    """Exceptions that report a problem the user can fix (one line, exit code 1)."""
    from redrafter_mlx.engine.loading import LoadError
    from tuning.measure import TuneError
    from tuning.search import SearchError
    from weights_convert.errors import ConversionError

    return (LoadError, ConversionError, TuneError, SearchError, ValueError, OSError)


@contextlib.contextmanager
def cli_errors(verbose: bool = False, interrupted: str = "interrupted") -> Iterator[None]:
    """The one error path of every command: one red ``error:`` line and an exit code.

    FlagError and engine ParamError (named by its flag) -> 2; user errors (load, convert,
    tune, data, OS) -> 1; Ctrl-C -> 130 with ``interrupted``; anything else is a bug, still one
    line. ``--verbose`` adds the traceback. typer's own exits pass through.
    """
    from redrafter_mlx.engine.errors import ParamError

    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except FlagError as e:
        _maybe_traceback(verbose)
        raise fail(str(e), code=2) from None
    except ParamError as e:
        _maybe_traceback(verbose)
        raise fail(f"{flag_for(e.param)}: {e.message}", code=2) from None
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


# --------------------------------------------------------------------------- flag validation


@dataclass(frozen=True)
class SamplingFlags:
    """The sampling flags as typed, None where not given (the model's defaults fill them)."""

    temp: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    logit_bias: str | None = None


@dataclass(frozen=True)
class Sampling:
    """Sampling settings, validated; ``sampler`` and ``seed`` feed ``stream_generate``.

    ``given``: the fields set by flags; ``origin``: where the others came from when a model's
    ``generation_config.json`` set them (empty: the engine's defaults).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    given: frozenset[str] = frozenset()
    origin: str = ""

    @classmethod
    def make(cls, flags: SamplingFlags = SamplingFlags()) -> Sampling:
        """Validate the flags (a ParamError names the field, cli_errors the flag)."""
        from redrafter_mlx.engine.sampling import check_seed

        values = dict(
            temperature=flags.temp,
            top_p=flags.top_p,
            top_k=flags.top_k,
            min_p=flags.min_p,
            repetition_penalty=flags.repetition_penalty,
        )
        set_ = {k: v for k, v in values.items() if v is not None}
        sampling = cls(
            **set_,
            seed=check_seed(flags.seed),
            repetition_context_size=flags.repetition_context_size,
            logit_bias=parse_logit_bias(flags.logit_bias),
            given=frozenset(set_),
        )
        sampling.sampler.validate()
        return sampling

    def with_model_defaults(self, folder) -> Sampling:
        """Fields not given by a flag take the model's ``generation_config.json`` values."""
        from dataclasses import replace

        from redrafter_mlx.engine.sampling import GENERATION_CONFIG, model_defaults

        found = {k: v for k, v in model_defaults(folder).items() if k not in self.given}
        if not found:
            return self
        return replace(self, **found, origin=GENERATION_CONFIG)

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic (argmax)."""
        return self.temperature <= 0.0

    @property
    def sampler(self) -> SamplerConfig:
        """The engine's :class:`SamplerConfig` of these settings."""
        from redrafter_mlx.engine.sampling import SamplerConfig

        return SamplerConfig(
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            logit_bias=self.logit_bias,
        )

    def describe(self) -> str:
        """``temp 0.2 · top-p 0.9 (generation_config.json)``: the values in force, and whence."""
        parts = ["greedy"] if self.greedy else [f"temp {self.temperature:g}"]
        if not self.greedy:
            parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
            parts += [f"top-k {self.top_k}"] if self.top_k else []
            parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        if self.repetition_penalty != 1.0:
            parts.append(
                f"repetition penalty {self.repetition_penalty:g} over "
                f"{self.repetition_context_size} tokens"
            )
        if self.logit_bias:
            parts.append(f"logit bias on {len(self.logit_bias)} tokens")
        defaults = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"} - self.given
        if self.origin and defaults:
            whence = "model's " + self.origin + (", flags" if self.given else "")
        else:
            whence = "flags" if self.given else "default"
        return " · ".join(parts) + f" ({whence})"

    def kwargs(self) -> dict:
        """The settings as a JSON-ready dict (``--json`` output)."""
        return dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            logit_bias={str(t): b for t, b in self.logit_bias},
        )


def parse_logit_bias(text: str | None) -> tuple[tuple[int, float], ...]:
    """``--logit-bias``: ``"ID:BIAS,ID:BIAS"`` or a JSON object -> ((id, bias), ...)."""
    import json
    import math

    if text is None or not text.strip():
        return ()
    form = 'use "ID:BIAS,ID:BIAS" (e.g. "13:-100,42:2.5") or a JSON object {"13": -100}'
    try:
        if text.lstrip().startswith("{"):
            pairs = list(json.loads(text).items())
        else:
            pairs = [item.split(":" if ":" in item else "=", 1) for item in text.split(",")]
        bias = tuple((int(str(t).strip()), float(b)) for t, b in pairs)
    except (ValueError, TypeError, AttributeError):
        raise FlagError(f"--logit-bias {text!r} is not understood; {form}") from None
    for token, value in bias:
        if token < 0 or not math.isfinite(value):
            raise FlagError(
                f"--logit-bias needs token ids >= 0 and finite biases, got {token}:{value}"
            )
    return bias


def check_dtype(dtype: str | None) -> str | None:
    """The --dtype value, or FlagError listing the valid ones."""
    if dtype is not None and dtype not in DTYPES:
        raise FlagError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def check_max_tokens(max_tokens: int) -> int:
    """--max-tokens must be positive."""
    if max_tokens < 1:
        raise FlagError(f"--max-tokens must be >= 1, got {max_tokens}")
    return max_tokens


# --------------------------------------------------------------------------- model choice


@dataclass(frozen=True)
class ModelPaths:
    """Where the model and drafter come from, and notes to show when they are loaded.

    ``demo`` when the bundled model is used.
    """

    model: str
    drafter: str | None
    demo: bool = False
    notes: tuple[str, ...] = ()


def installed_bundled(model: str | None):
    """The bundled model ``--model`` names (``demo``, ``smollm2``; no ``--model``: the default
    one), checked to be installed; None when ``model`` names something else (a folder, a Hub
    id). Raises ``LoadError`` with the command that installs it."""
    from redrafter_mlx.engine.bundled import bundled, default_model

    named = default_model() if model is None else bundled(model)
    if named is not None and not named.installed:
        from redrafter_mlx.engine.loading import LoadError

        fix = (
            "run 'make smollm2' (part of make install)"
            if named.name == "smollm2"
            else "rebuild it with 'make demo-model'"
        )
        raise LoadError(
            f"the {named.name} model is not installed ({named.base} has no config.json); "
            f"{fix}, or pass --model DIR"
        )
    return named


def resolve_paths(model: str | None, drafter: str | None) -> ModelPaths:
    """``--model``/``--drafter`` as given; ``demo``/``smollm2`` name the bundled models; no
    ``--model`` is SmolLM2 when installed with its drafter, else the demo model.

    A converted model directory's own drafter (``MODEL/drafter``, written by ``convert
    --drafter``) is used when no ``--drafter`` is given. Nothing is printed here: the notes
    are shown by :func:`load_engine`, after every flag has been checked.
    """
    named = installed_bundled(model)
    if named is not None:
        chosen = drafter if drafter is not None else (str(named.drafter) if named.drafter else None)
        return ModelPaths(str(named.base), chosen, demo=named.name == "demo", notes=(named.note,))
    _check_model_name(model)
    own = Path(model).expanduser() / "drafter"
    if drafter is None and (own / "config.json").is_file():
        note = f"using the drafter converted with the model: {own} (--drafter to choose another)"
        return ModelPaths(model, str(own), notes=(note,))
    from redrafter_mlx.engine.bundled import bundled_drafter_for

    packaged = bundled_drafter_for(model) if drafter is None else None
    if packaged is not None:
        note = f"using the packaged SmolLM2 drafter: {packaged} (--drafter to choose another)"
        return ModelPaths(model, str(packaged), notes=(note,))
    return ModelPaths(model, drafter)


def _check_model_name(model: str) -> None:
    """A LoadError listing the bundled models for a ``--model`` word that names nothing."""
    from redrafter_mlx.engine.bundled import unknown_name_error

    message = unknown_name_error(model)
    if message is not None:
        from redrafter_mlx.engine.loading import LoadError

        raise LoadError(message)


def check_shape(shape: BeamShape, flag: str | None = None) -> BeamShape:
    """Validate a speculative beam shape with the engine's rules; ``flag``: the one flag
    that gave the whole shape (``--grid``), named in the error instead of the field's."""
    from redrafter_mlx.engine.shape import ShapeError

    if flag is None and shape.length < 2:
        raise FlagError(
            f"--beam-length must be >= 2 (it counts the init token), got {shape.length}; "
            f"use --no-draft for plain decoding"
        )
    try:
        return shape.validate()  # a ShapeError names its field: cli_errors names the flag
    except ShapeError as e:
        if flag is None:
            raise
        where = f"{flag} {shape.width}x{shape.length}"
        if e.param == "capacity":
            where = f"--capacity with {where}"
        raise FlagError(f"{where}: {e.message}") from None


def resolve_plan(paths: ModelPaths, dtype: str | None, beam: BeamFlags) -> ShapeChoice:
    """The beam shape: flags override the tuned profile / chip preset; context-lookup chains
    join it unless ``--no-lookup`` or the tuner measured them (its profile's chains, or their
    absence, stand unless --lookup/--lookup-length/--no-lookup say otherwise); no drafter ->
    the tuned lookup-only profile, else lookup alone, or AR."""
    from dataclasses import replace

    from redrafter_mlx.engine.shape import AR, BeamShape
    from tuning import ShapeChoice, preset_choice, resolve_beam_shape, tuned_choice

    chains, chain_length = beam.lookup_chains()
    lookup_flags = beam.no_lookup or beam.lookup is not None or beam.lookup_length is not None
    if beam.no_draft:
        return ShapeChoice(AR, "--no-draft: plain decoding")
    if paths.drafter is None:
        why = "the demo model has no drafter yet" if paths.demo else "no --drafter given"
        tuned = None if lookup_flags else tuned_choice(paths.model, None, dtype)
        if tuned is not None and tuned.lookup_tuned:
            return tuned  # tune measured lookup alone here: its chains, or plain decoding
        if chains:
            lookup = BeamShape.lookup_only(chains, chain_length)
            return ShapeChoice(lookup, f"{why}: context lookup alone (--no-lookup: plain)")
        return ShapeChoice(AR, f"{why}: plain decoding")
    choice = resolve_beam_shape(paths.model, paths.drafter, dtype)
    if any(v is not None for v in (beam.width, beam.length, beam.capacity)):
        from redrafter_mlx.engine.generation import DEFAULT_SHAPE

        base = choice.shape if choice.shape.drafts else DEFAULT_SHAPE
        shape = BeamShape(
            beam.width if beam.width is not None else base.width,
            beam.length if beam.length is not None else base.length,
            beam.capacity,
        )
        check_shape(shape)
        warn_untrained_length(shape, paths.drafter)
        choice = ShapeChoice(shape, "beam shape from flags")
    if choice.lookup_tuned and not lookup_flags:
        return choice  # tune measured the chains: keep them (or their absence) as tuned
    if not choice.speculative:
        return choice
    drafted = choice.shape
    if drafted.lookup:  # the tuned chains give way to the flags': the drafter's part alone
        capacity = drafted.capacity
        if capacity is not None:
            capacity -= drafted.lookup * (drafted.chain_length - 1)
        drafted = replace(drafted, capacity=capacity, lookup=0, lookup_length=0)
        source = choice.source if chains else f"{choice.source}, without lookup chains"
        if not drafted.drafts and not chains:  # --no-lookup, lookup alone tuned: the preset
            preset = preset_choice(paths.drafter)
            drafted, source = preset.shape, f"{source}; drafter shape from the {preset.source}"
        choice = ShapeChoice(drafted, source)
    if not chains:
        return choice
    shape = replace(drafted, lookup=chains, lookup_length=chain_length)
    if drafted.capacity is not None:  # the drafter's slots, plus the chains' own
        shape = replace(shape, capacity=drafted.capacity + chains * (chain_length - 1))
    return ShapeChoice(shape.validate(), f"{choice.source}, with context lookup")


def warn_untrained_length(shape: BeamShape, drafter: str | None) -> None:
    """Warn when --beam-length asks for more draft steps than the drafter was trained for."""
    from tuning.grid import max_length_for, read_predict_tokens

    predict = read_predict_tokens(drafter)
    limit = max_length_for(predict)
    if limit is not None and shape.length > limit:
        err_console().print(
            f"warning: --beam-length {shape.length} exceeds what the drafter was trained for "
            f"(it predicts {predict} tokens: length <= {limit}); drafts past that are guesses",
            style="yellow",
        )


@dataclass
class Engine:
    """A loaded model, its drafter (None for plain decoding) and tokenizer."""

    model: object
    drafter: object
    tokenizer: object
    paths: ModelPaths
    dtype: str
    folder: Path | None = None  # the model's local folder (a Hub id resolved)


def load_engine(paths: ModelPaths, dtype: str | None, with_drafter: bool = True) -> Engine:
    """Load the model (and the drafter when ``with_drafter``); LoadError on any problem.

    Under ``mlx.launch`` (several processes) each loads its shard of the model
    (``engine/distributed.py``) and the whole drafter; only rank 0 prints.
    """
    from redrafter_mlx import load
    from redrafter_mlx.engine.distributed import world
    from redrafter_mlx.engine.platform import fit_blas_threads

    group = world()
    follow_rank0(group)
    for note in paths.notes:
        err_console().print(note, style="dim")
    drafter_path = paths.drafter if with_drafter else None
    from redrafter_mlx.engine.loading import resolve_path

    model, drafter, tokenizer = load(paths.model, drafter_path, dtype, group)
    fit_blas_threads(model, drafter)
    return Engine(model, drafter, tokenizer, paths, dtype_name(model), resolve_path(paths.model))


@dataclass(frozen=True)
class BeamFlags:
    """``--beam-width``, ``--beam-length``, ``--capacity``, ``--no-draft``, ``--lookup``,
    ``--lookup-length`` and ``--no-lookup`` as given."""

    width: int | None = None
    length: int | None = None
    capacity: int | None = None
    no_draft: bool = False
    lookup: int | None = None
    lookup_length: int | None = None
    no_lookup: bool = False

    def lookup_chains(self) -> tuple[int, int]:
        """(chains, chain length) asked for, defaults filled in; FlagError when invalid."""
        from redrafter_mlx.engine.lookup import DEFAULT_CHAIN_LENGTH, DEFAULT_CHAINS

        if self.no_lookup and self.lookup:
            raise FlagError(f"--no-lookup contradicts --lookup {self.lookup}; give one of them")
        chains = 0 if self.no_lookup else (DEFAULT_CHAINS if self.lookup is None else self.lookup)
        if chains < 0:
            raise FlagError(f"--lookup must be >= 0 (0 = off), got {chains}")
        length = DEFAULT_CHAIN_LENGTH if self.lookup_length is None else self.lookup_length
        if length < 2:
            raise FlagError(
                f"--lookup-length must be >= 2 (it counts the init token), got {length}"
            )
        return chains, length


@dataclass
class Prepared:
    """What :func:`prepare_engine` set up: the loaded engine, its plan and the checked flags."""

    engine: Engine
    plan: Any  # a ShapeChoice, or what the command's ``choose`` returned
    sampling: Sampling | None  # None when no sampling flags were given
    checked: Any = None  # what the command's ``check`` returned


def prepare_engine(
    model: str | None,
    drafter: str | None,
    dtype: str | None,
    beam: BeamFlags = BeamFlags(),
    *,
    sampling: SamplingFlags | None = None,
    max_tokens: int | None = None,
    check: Callable[[], Any] | None = None,
    choose: Callable[[ModelPaths], tuple[Any, bool]] | None = None,
    model_defaults: bool = True,
    batch: int = 1,
    max_kv_size: int | None = None,
    split_ok: bool = False,
) -> Prepared:
    """The set-up of chat, generate, serve and bench: check the flags, resolve, plan, load.

    In this order (the first bad flag is the one reported): the sampling flags
    (``SamplingFlags``), ``--max-tokens``, ``--dtype``, the command's own
    ``check()`` (its result is ``Prepared.checked``), the model and drafter paths, the beam
    plan (``resolve_plan`` from ``beam``, or the command's ``choose(paths) -> (plan,
    speculative)``), then loading, with the drafter only when the plan speculates.
    Sampling settings not given by a flag then take the model's ``generation_config.json``
    values (``model_defaults``; bench keeps the engine's greedy default), and logit-bias ids
    are checked against the vocabulary. Last, a step of the plan's shape over ``batch`` rows
    must fit in memory. Under ``mlx.launch`` the model is split across the ranks
    (``load_engine``), which a command must say it handles (``split_ok``).
    """
    from redrafter_mlx.engine.distributed import world

    group = world()
    if group is not None and not split_ok:
        raise ValueError(
            "this command does not run under mlx.launch yet (chat, generate, bench, serve and "
            "tune do); start it as one process"
        )
    follow_rank0(group)
    flags = Sampling.make(sampling) if sampling is not None else None
    if max_tokens is not None:
        check_max_tokens(max_tokens)
    if max_kv_size is not None and max_kv_size < MIN_KV_SIZE:
        raise FlagError(f"--max-kv-size must be >= {MIN_KV_SIZE} tokens, got {max_kv_size}")
    check_dtype(dtype)
    checked = check() if check is not None else None
    paths = resolve_paths(model, drafter)
    if choose is None:
        plan = same_plan_everywhere(resolve_plan(paths, dtype, beam))
        speculative = plan.speculative
    else:
        plan, speculative = choose(paths)
    engine = load_engine(paths, dtype, with_drafter=speculative)
    engine.model.cap_context(max_kv_size)
    if flags is not None:
        if model_defaults:
            flags = flags.with_model_defaults(engine.folder)
        flags.sampler.validate(engine.model.vocab_size)
    if hasattr(plan, "shape"):  # a ShapeChoice: refuse a step that cannot fit, before compiling
        sampled = flags is None or not flags.greedy  # serve's rows may sample
        check_memory(engine, plan.shape, max_tokens, sampled, batch)
    return Prepared(engine, plan, flags, checked)


def same_plan_everywhere(plan):
    """Under ``mlx.launch``, rank 0's beam shape on every rank (each host may hold its own
    tuning profile, but the ranks must run one compiled step); ``plan`` alone."""
    from dataclasses import replace

    from redrafter_mlx.engine.distributed import broadcast_text, world
    from redrafter_mlx.engine.shape import BeamShape

    group = world()
    if group is None or not hasattr(plan, "shape"):
        return plan
    label = broadcast_text(plan.shape.label, group)
    return plan if label == plan.shape.label else replace(plan, shape=BeamShape.parse(label))


class _ErrorsOnly:
    """A stderr for ranks other than 0: only ``error:`` lines, each naming the rank."""

    def __init__(self, stream, rank: int):
        self.stream, self.rank = stream, rank

    def write(self, text: str) -> int:
        if "error" in text:
            self.stream.write(f"[rank {self.rank}] {text}")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def follow_rank0(group) -> None:
    """Under ``mlx.launch``, ranks other than 0 print nothing but their errors from now on
    (rank 0 prints for all); alone, or on rank 0, nothing changes."""
    if group is None or group.rank() == 0 or isinstance(sys.stderr, _ErrorsOnly):
        return
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    sys.stderr = _ErrorsOnly(sys.__stderr__, group.rank())


def check_memory(
    engine: Engine, shape: BeamShape, max_tokens: int | None, sampling: bool, batch: int = 1
) -> None:
    """ShapeTooLarge (a ParamError: one line naming the flag) when a step of ``shape`` over
    ``batch`` rows needs more memory than the machine has; the prompt is unknown yet, so a
    short one."""
    from redrafter_mlx.engine.memory import check_step_memory

    tokens = 64 + (max_tokens or 256)
    check_step_memory(engine.model, engine.drafter, shape, batch, tokens, sampling)


def dtype_name(model) -> str:
    """The float dtype the model's weights were loaded in (``float32``...)."""
    import mlx.core as mx

    dt = model.model.norm.weight.dtype
    for name in DTYPES:
        if dt == getattr(mx, name):
            return name
    return str(dt)


# --------------------------------------------------------------------------- stats rendering


FINISH_TEXT = {
    "stop": None,
    "length": "stopped at --max-tokens",
    "context": "stopped: the context is full (the model's, or --max-kv-size)",
}


def format_hist(hist: list[int]) -> str:
    """``steps emitting 1/2/3/4 tokens: 12/5/2/1`` (accepted drafts + the bonus token)."""
    if not hist or not any(hist):
        return ""
    sizes = "/".join(str(i) for i in range(1, len(hist) + 1))
    return f"steps emitting {sizes} tokens: " + "/".join(str(n) for n in hist)


def lookup_share(accepted: int, looked_up: int) -> str:
    """``accepted drafts: 12 drafter + 30 lookup``: where the accepted tokens came from."""
    return f"accepted drafts: {accepted - looked_up} drafter + {looked_up} lookup"


def stats_line(response, plan: ShapeChoice) -> str:
    """The one-line summary after an answer: tokens, speed, acceptance, why it ended, shape."""
    parts = [f"{response.generation_tokens} tokens", f"{response.generation_tps:.1f} tok/s"]
    if plan.speculative:
        parts.append(f"{response.tokens_per_step:.2f} tok/step")
        hist = format_hist(response.accept_hist)
        if hist:
            parts.append(hist)
        if plan.shape.lookup:
            parts.append(lookup_share(response.accepted_tokens, response.lookup_tokens))
    parts.append(f"TTFT {response.time_to_first_token * 1e3:.0f} ms")
    finish = FINISH_TEXT.get(response.finish_reason)
    if finish:
        parts.append(finish)
    parts.append(f"{plan.label} ({plan.source})")
    return " · ".join(parts)


def response_stats(response) -> dict:
    """All statistics of a final GenerationResponse as a JSON-ready dict."""
    return response.stats.to_dict()
