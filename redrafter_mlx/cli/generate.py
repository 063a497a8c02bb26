"""``redrafter-mlx generate``: one prompt in, the streamed answer out, then a stats line.

Like ``mlx_lm.generate``: the answer streams to stdout (control characters shown visibly,
``cli.terminal``) and the stats go to stderr; ``--json`` prints one machine-readable object
instead (the exact text); ``--no-draft`` is the
autoregressive baseline through the same engine; ``--raw`` skips the chat template.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import typer

from redrafter_mlx.cli.common import (
    BeamFlags,
    Engine,
    branch_flags,
    check_prompt_fits,
    prepare_engine,
)
from redrafter_mlx.cli.consoles import err_console, out_console
from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.options import (
    MAX_TOKENS_BRANCHES,
    BranchFlags,
    DtypeOpt,
    MaxKvSizeOpt,
    ModelFlags,
    NoAdaptOpt,
    SamplingFlags,
    ShapeFlags,
    SystemPromptOpt,
    VerboseOpt,
    flag_groups,
)
from redrafter_mlx.cli.stats import answer_branch_stats, response_stats, stats_line
from redrafter_mlx.cli.terminal import visible
from tuning import ShapeChoice

if TYPE_CHECKING:
    from redrafter_mlx.engine.core.sampling import SamplerConfig


def read_prompt(prompt: str | None) -> str:
    """The prompt text: the flag's value, or all of stdin for ``-`` (bytes that are not
    UTF-8 in either reach the tokenizer as U+FFFD)."""
    if prompt is None:
        raise FlagError("pass --prompt TEXT (or --prompt - to read it from stdin)")
    if prompt == "-":
        from redrafter_mlx.cli.chat_ui import tolerant_stdin

        tolerant_stdin()
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise FlagError("the prompt is empty; pass --prompt TEXT")
    return prompt


def shared_prompt(prompt: str | None) -> str:
    """``read_prompt``, refusing ``-`` under ``mlx.launch``: it forwards stdin to the ranks but
    never its end, so a read to the end would wait forever (every rank refuses alike)."""
    from redrafter_mlx.engine.base.distributed import world

    if prompt == "-" and world() is not None:
        raise FlagError(
            "--prompt -: under mlx.launch stdin never ends; pass the text, e.g. "
            '--prompt "$(cat prompt.txt)"'
        )
    return read_prompt(prompt)


def prompt_ids(tokenizer, text: str, chat: bool, system: str | None) -> list[int]:
    """Token ids: one user turn in the chat format, or the raw text with BOS (``--raw``)."""
    if chat:
        return tokenizer.chat_prompt([{"role": "user", "content": text}], system=system)
    return tokenizer.encode(text)


@dataclass
class Generation:
    """The whole answer of one run: text, token ids, which came from the drafter, last stats."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)
    final: object = None


def run_generation(
    engine: Engine,
    plan: ShapeChoice,
    ids: list[int],
    max_tokens: int,
    sampling: SamplerConfig,
    echo: bool,
    adapt: bool = True,
    branches=None,
) -> Generation:
    """Stream one answer (echoing text to stdout when ``echo``) and collect it; ``adapt``:
    let the loop switch beam shapes by measured tokens/s (``--no-adapt`` pins);
    ``branches``: the ``--branches`` rules (``branch_flags``; with branches on, the text is
    the rebuilt text)."""
    from redrafter_mlx.engine.loop.generation import stream_generate

    out = Generation()
    console = out_console()
    for response in stream_generate(
        engine.model,
        engine.drafter,
        engine.tokenizer,
        ids,
        max_tokens=max_tokens,
        shape=plan.shape,
        sampler=sampling,
        adapt=adapt,
        draft_model=engine.draft_model,
        branches=branches,
    ):
        out.text += response.text
        out.tokens += response.tokens
        out.drafted += response.drafted_tokens
        out.final = response
        if echo and response.text:
            console.print(visible(response.text), end="", markup=False, emoji=False)
    if echo:
        console.print()
    return out


def result_json(
    engine: Engine, plan: ShapeChoice, sampling: SamplerConfig, result: Generation, chat: bool
) -> dict:
    """The ``--json`` object: text, token ids, finish reason, stats, APAR branches (forks,
    sequential steps, answer tokens, per step and per second: what the stats line says;
    null with branching off), beam, paths, dtype."""
    final = result.final
    return {
        "text": result.text,
        "tokens": result.tokens,
        "drafted_tokens": sum(result.drafted),
        "finish_reason": final.finish_reason,
        "stats": response_stats(final),
        "branches": answer_branch_stats(final, len(result.tokens)),
        "beam": plan.to_dict(),
        "sampling": sampling.to_dict(),
        "chat_template": chat,
        "model": engine.paths.model,
        "drafter": engine.paths.drafter if plan.speculative else None,
        "draft_model": engine.paths.draft_model if engine.draft_model is not None else None,
        "demo": engine.paths.demo,
        "dtype": engine.dtype,
    }


@dataclass(frozen=True)
class GenerateFlags:
    """``generate``'s options, in the order ``--help`` lists them."""

    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            help="The prompt text, or - to read it from stdin.",
            show_default=False,
        ),
    ] = None
    models: ModelFlags = field(default_factory=ModelFlags)
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-m", "-n", help=f"Most tokens in the answer. {MAX_TOKENS_BRANCHES}"
        ),
    ] = 256
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    system_prompt: SystemPromptOpt = None
    max_kv_size: MaxKvSizeOpt = None
    shape: ShapeFlags = field(default_factory=ShapeFlags)
    no_adapt: NoAdaptOpt = False
    branching: BranchFlags = field(default_factory=BranchFlags)
    dtype: DtypeOpt = None
    chat: Annotated[
        bool,
        typer.Option(
            "--chat/--raw", help="Wrap the prompt in the chat template, or feed it as is."
        ),
    ] = True
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON object to stdout."),
    ] = False
    verbose: VerboseOpt = False


@flag_groups
def generate(flags: GenerateFlags) -> None:
    """Generate a continuation of one prompt with ReDrafter speculative decoding."""
    with cli_errors(flags.verbose):
        models = flags.models
        ready = prepare_engine(
            models.model,
            models.drafter,
            flags.dtype,
            BeamFlags.of(flags.shape),
            sampling=flags.sampling,
            max_tokens=flags.max_tokens,
            max_kv_size=flags.max_kv_size,
            check=lambda: shared_prompt(flags.prompt),
            split_ok=True,
            draft_model=models.draft_model,
        )
        engine, plan, sampling = ready.engine, ready.plan, ready.sampling
        if ready.sampling_origin and not flags.as_json:  # values the user did not type: say so
            err_console().print(f"sampling: {ready.sampling_note}", style="dim", markup=False)
        ids = prompt_ids(engine.tokenizer, ready.checked, flags.chat, flags.system_prompt)
        check_prompt_fits(engine.model, len(ids))
        result = run_generation(
            engine,
            plan,
            ids,
            flags.max_tokens,
            sampling,
            echo=not flags.as_json,
            adapt=not flags.no_adapt,
            branches=branch_flags(engine, flags.branching),
        )
        if flags.as_json:
            print(json.dumps(result_json(engine, plan, sampling, result, flags.chat)))
        else:
            err_console().print(
                stats_line(result.final, plan, len(result.tokens)), style="dim", markup=False
            )
