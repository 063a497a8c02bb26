"""The typer option types every command shares (``--model``, ``--drafter``, sampling and beam
flags), so each flag is spelled and documented once, following ``mlx_lm.generate`` /
``mlx_lm.chat``. The sampling flags are one group, ``SamplingFlags``, that
``sampling_options`` puts in a command's signature. Only typer and the standard library are
imported (``--help`` stays fast)."""

from __future__ import annotations

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
        "recurrent drafter's beams. Give it twice, a draft model and an early-exit folder, "
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
    once: ``sampling_options`` makes each field an option of a command, in this order.
    ``cli.common.sampling_fields`` turns them into ``SamplerConfig`` fields."""

    temp: TempOpt = None
    top_p: TopPOpt = None
    top_k: TopKOpt = None
    min_p: MinPOpt = None
    seed: SeedOpt = None
    repetition_penalty: RepetitionPenaltyOpt = None
    repetition_context_size: RepetitionContextOpt = 20
    logit_bias: LogitBiasOpt = None


def sampling_options(command: Callable) -> Callable:
    """``command`` with ``SamplingFlags``' fields as its options, where its one parameter
    typed ``SamplingFlags`` stands (so ``--help`` lists them there); typer sees the fields,
    the command gets them as one ``SamplingFlags``. TypeError, at import, when the command
    has no such parameter or one of its own already takes a field's name."""
    signature = inspect.signature(command, eval_str=True)
    slots = [p for p in signature.parameters.values() if p.annotation is SamplingFlags]
    if len(slots) != 1:
        raise TypeError(f"{command.__name__} needs one parameter typed SamplingFlags")
    slot = slots[0]
    types = typing.get_type_hints(SamplingFlags, include_extras=True)
    options = [
        inspect.Parameter(f.name, slot.kind, default=f.default, annotation=types[f.name])
        for f in fields(SamplingFlags)
    ]
    taken = sorted({o.name for o in options} & set(signature.parameters))
    if taken:
        raise TypeError(f"{command.__name__}: {', '.join(taken)} clash with SamplingFlags")
    params = []
    for param in signature.parameters.values():
        params += options if param is slot else [param]

    @functools.wraps(command)
    def with_flags(*args, **kwargs):
        given = {o.name: kwargs.pop(o.name) for o in options if o.name in kwargs}
        return command(*args, **kwargs, **{slot.name: SamplingFlags(**given)})

    with_flags.__signature__ = signature.replace(parameters=params)
    with_flags.__annotations__ = {p.name: p.annotation for p in params}
    if signature.return_annotation is not signature.empty:
        with_flags.__annotations__["return"] = signature.return_annotation
    return with_flags


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
