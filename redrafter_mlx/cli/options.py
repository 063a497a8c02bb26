"""The typer option types every command shares (``--model``, ``--drafter``, sampling and beam
flags), so each flag is spelled and documented once, following ``mlx_lm.generate`` /
``mlx_lm.chat``, and the flag groups commands read their options from.

A flag group is a frozen dataclass whose fields are typer options (``Annotated[type,
typer.Option(...)]``, the default the field's) or flag groups themselves: ``SamplingFlags``,
``ModelFlags``, ``ShapeFlags``, ``BranchFlags`` here, one group per command beside it.
``flag_groups`` puts a group's options in a command's signature where its parameter stands,
and hands the command one value per group. Only typer and the standard library are imported
(``--help`` stays fast)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated

import typer

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
DraftModelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--draft-model",
        help="A draft model sharing --model's tokenizer (a directory, a Hugging Face repo id, "
        "or a bundled model: smollm2, demo): its greedy chain of L tokens (the beam length, "
        "else 4) joins the drafter's beams and the lookup chains in one verified tree. "
        "--draft-model set to --model drafts with the model itself. An early-exit adapter's "
        "folder (config.json kind early-exit) works too: its chain runs beside the "
        "recurrent drafter's beams. A published draft head's folder (EAGLE-3, DFlash, an MTP "
        "sidecar) drafts its chain; self-mtp drafts with the model's own MTP layers "
        "(Qwen3.5, Qwen3-Next). Give it twice, a draft model and an early-exit folder, "
        "for both chains in one tree.",
        show_default=False,
    ),
]
TempOpt = Annotated[
    float | None,
    typer.Option(
        "--temp",
        help="Sampling temperature in [0, 1e6], 0 (or below 1e-11) = greedy (default: the "
        "model's generation_config.json value in chat and generate, else 0; bench: 0).",
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
        help="Keep only the k most likely tokens, 0 (or the vocabulary size or more) = off "
        "(default: the model's in chat and generate, else 0).",
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
        "logits divided by it, negative multiplied (> 1 discourages repeats; 1 = off; in "
        "[1e-6, 1e6]; default: the model's in chat and generate, else off).",
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


@dataclass(frozen=True)
class SamplingFlags:
    """The sampling flags of chat, generate and bench, as typed (None: not given, so the
    model's ``generation_config.json`` value or the engine's default holds), declared here
    once, a flag group (``flag_groups`` makes each field an option of a command, in this
    order). ``cli.common.sampling_fields`` turns them into ``SamplerConfig`` fields."""

    temp: TempOpt = None
    top_p: TopPOpt = None
    top_k: TopKOpt = None
    min_p: MinPOpt = None
    seed: SeedOpt = None
    repetition_penalty: RepetitionPenaltyOpt = None
    repetition_context_size: RepetitionContextOpt = 20
    logit_bias: LogitBiasOpt = None


# --max-tokens with branches: one rule (engine/core/branches.py, "The answer's length")
MAX_TOKENS_BRANCHES = (
    "With APAR branches it bounds the answer, not each branch: the answer is the first N "
    "tokens of the rebuilt text (a branch stops once all it could still write lies past them)."
)
BranchesOpt = Annotated[
    str,
    typer.Option(
        "--branches",
        help="APAR parallel branches: auto (on when the model's config.json marks it an APAR "
        "model, e.g. a converted THUDM/apar-7b), on (needs its split tokens), off. Each "
        "branch decodes as a row of its own; the answer is the rebuilt text, and --max-tokens "
        "bounds it (its first N tokens), not each branch.",
    ),
]
BranchDepthOpt = Annotated[
    int | None,
    typer.Option(
        "--branch-depth",
        help="APAR: deepest branch that may still fork (the root is 0; default 2, APAR's).",
        show_default=False,
    ),
]
MaxBranchesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-branches",
        help="APAR: most branches per answer, the root counted (default 32, APAR's).",
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
        help="float16, bfloat16 or float32 (default: float16 on a GPU, Metal or CUDA; "
        "float32 on CPU).",
        show_default=False,
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors.")]

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ModelFlags:
    """What chat, generate, serve and bench load: ``--model``, ``--drafter`` and
    ``--draft-model``, as typed (``paths.resolve_paths`` resolves them)."""

    model: ModelOpt = None
    drafter: DrafterOpt = None
    draft_model: DraftModelOpt = None


@dataclass(frozen=True)
class ShapeFlags:
    """The beam-shape flags as typed: ``--beam-width``, ``--beam-length``, ``--capacity``,
    ``--no-draft``, ``--lookup``, ``--lookup-length``, ``--no-lookup`` (``common.BeamFlags.of``
    makes the engine's plan arguments of them)."""

    beam_width: BeamWidthOpt = None
    beam_length: BeamLengthOpt = None
    capacity: CapacityOpt = None
    no_draft: NoDraftOpt = False
    lookup: LookupOpt = None
    lookup_length: LookupLengthOpt = None
    no_lookup: NoLookupOpt = False


@dataclass(frozen=True)
class BranchFlags:
    """APAR's flags as typed: ``--branches``, ``--branch-depth``, ``--max-branches``
    (``common.branch_flags`` turns them into the loaded model's branch rules)."""

    branches: BranchesOpt = "auto"
    branch_depth: BranchDepthOpt = None
    max_branches: MaxBranchesOpt = None


def is_group(annotation) -> bool:
    """Whether a parameter's or a field's type is a flag group (a dataclass)."""
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def group_options(group: type, kind=inspect.Parameter.KEYWORD_ONLY) -> list[inspect.Parameter]:
    """The typer options of a flag group, nested groups' in place, in field order (a field
    without a default: ``...``, typer's required option)."""
    types = typing.get_type_hints(group, include_extras=True)
    options = []
    for f in fields(group):
        if is_group(types[f.name]):
            options += group_options(types[f.name], kind)
            continue
        default = f.default
        if default is dataclasses.MISSING:
            missing = f.default_factory is dataclasses.MISSING
            default = ... if missing else f.default_factory()
        options.append(inspect.Parameter(f.name, kind, default=default, annotation=types[f.name]))
    return options


def build_group(group: type, given: dict):
    """The flag group of the options in ``given`` (each taken out of it; absent ones keep the
    field's default)."""
    types = typing.get_type_hints(group, include_extras=True)
    values = {}
    for f in fields(group):
        if is_group(types[f.name]):
            values[f.name] = build_group(types[f.name], given)
        elif f.name in given:
            values[f.name] = given.pop(f.name)
    return group(**values)


def flag_groups(command: Callable) -> Callable:
    """``command`` with each parameter typed by a flag group replaced by the group's options,
    where the parameter stands (so ``--help`` lists them there); typer sees the options, the
    command gets one value per group. TypeError, at import, when an option's name is taken
    twice (by the command's own parameter or another group's option)."""
    signature = inspect.signature(command, eval_str=True)
    groups = {p.name: p.annotation for p in signature.parameters.values() if is_group(p.annotation)}
    params = []
    for param in signature.parameters.values():
        params += group_options(param.annotation, param.kind) if param.name in groups else [param]
    names = [p.name for p in params]
    for group in groups.values():
        taken = sorted({o.name for o in group_options(group) if names.count(o.name) > 1})
        if taken:
            raise TypeError(f"{command.__name__}: {', '.join(taken)} clash with {group.__name__}")

    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        built = {name: build_group(group, kwargs) for name, group in groups.items()}
        return command(*args, **kwargs, **built)

    with_flags.__signature__ = signature.replace(parameters=params)
    with_flags.__annotations__ = {p.name: p.annotation for p in params}
    if signature.return_annotation is not signature.empty:
        with_flags.__annotations__["return"] = signature.return_annotation
    return with_flags


def sampling_options(command: Callable) -> Callable:
    """``flag_groups`` for a command with one parameter typed ``SamplingFlags`` (TypeError, at
    import, without one): chat's, generate's and bench's sampling flags, declared once."""
    signature = inspect.signature(command, eval_str=True)
    slots = [p for p in signature.parameters.values() if p.annotation is SamplingFlags]
    if len(slots) != 1:
        raise TypeError(f"{command.__name__} needs one parameter typed SamplingFlags")
    return flag_groups(command)
