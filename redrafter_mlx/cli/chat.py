"""``redrafter-mlx chat``: a multi-turn terminal chat with ReDrafter speculative decoding.

Answers stream as the verifier accepts them; each turn reuses the KV cache of the
conversation so far (see :mod:`redrafter_mlx.cli.chat_ui` for the loop and in-chat commands).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import typer

from redrafter_mlx.cli.common import BeamFlags, branch_flags, prepare_engine
from redrafter_mlx.cli.consoles import out_console
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


def greeting(engine, plan, show_accepted: bool, sampling: str = "") -> str:
    """The first lines: which model, which beam shape and sampling and why, how to leave."""
    from redrafter_mlx.cli.chat_ui import DRAFTED_STYLE

    lines = [
        f"[bold]redrafter-mlx chat[/] · {engine.paths.model}{draft_sources(engine, plan)} "
        f"({engine.dtype})",
        f"[dim]beam {plan.label} ({plan.source})[/]",
        *([f"[dim]sampling: {sampling}[/]"] if sampling else []),
        "[dim]Type /help for commands; /quit or Ctrl-D leaves; Ctrl-C stops an answer.[/]",
    ]
    if show_accepted and plan.speculative:
        lines.append(
            f"[dim]Tokens accepted from drafts are shown in [{DRAFTED_STYLE}]{DRAFTED_STYLE}[/].[/]"
        )
    return "\n".join(lines)


def draft_sources(engine, plan) -> str:
    """`` + drafter D + draft model M + early-exit adapter A``: the draft models the chat
    loads beside the model (none for plain decoding)."""
    from redrafter_mlx.engine.drafting.early_exit import is_early_exit

    parts = []
    if plan.speculative and engine.drafter is not None:
        parts.append(f"drafter {engine.paths.drafter}")
    if plan.speculative and engine.draft_model is not None:
        given = engine.paths.draft_model
        for path in given if isinstance(given, tuple) else (given,):
            parts.append(f"{'early-exit adapter' if is_early_exit(path) else 'draft model'} {path}")
    return "".join(f" + {part}" for part in parts)


MAX_ANSWER_TOKENS = 1024


def answer_budget(context: int | None) -> int:
    """Default answer length: a quarter of the context (at most MAX_ANSWER_TOKENS), leaving
    room for the conversation so follow-ups keep earlier turns (and their cached K/V)."""
    return MAX_ANSWER_TOKENS if context is None else max(1, min(MAX_ANSWER_TOKENS, context // 4))


@dataclass(frozen=True)
class ChatFlags:
    """``chat``'s options, in the order ``--help`` lists them."""

    models: ModelFlags = field(default_factory=ModelFlags)
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            "-m",
            "-n",
            help="Most tokens per answer (default: a quarter of the model's context, at most "
            f"{MAX_ANSWER_TOKENS}, so a conversation fits). {MAX_TOKENS_BRANCHES}",
            show_default=False,
        ),
    ] = None
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    system_prompt: SystemPromptOpt = None
    max_kv_size: MaxKvSizeOpt = None
    shape: ShapeFlags = field(default_factory=ShapeFlags)
    no_adapt: NoAdaptOpt = False
    branching: BranchFlags = field(default_factory=BranchFlags)
    show_accepted: Annotated[
        bool,
        typer.Option(
            "--show-accepted",
            help="Colour the tokens accepted from drafts (drafter, lookup, draft model; with "
            "branches, each branch's).",
        ),
    ] = False
    dtype: DtypeOpt = None
    verbose: VerboseOpt = False


@flag_groups
def chat(flags: ChatFlags) -> None:
    """Chat with a model in the terminal, sped up by ReDrafter speculative decoding."""
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
            split_ok=True,
            draft_model=models.draft_model,
        )
        engine, plan = ready.engine, ready.plan
        max_tokens = flags.max_tokens
        if max_tokens is None:
            max_tokens = answer_budget(engine.model.max_context)

        from redrafter_mlx.cli.chat_ui import (
            ChatLoop,
            enable_line_editing,
            read_line,
            run_chat,
            settle_compiler_check,
        )

        console = out_console()
        console.print(greeting(engine, plan, flags.show_accepted, ready.sampling_note))
        loop = ChatLoop(
            engine,
            plan,
            ready.sampling,
            max_tokens,
            system=flags.system_prompt,
            show_accepted=flags.show_accepted,
            console=console,
        )
        loop.adapt = not flags.no_adapt
        loop.branches = branch_flags(engine, flags.branching)
        system = flags.system_prompt
        problem = None if system is None else loop.system_problem(system)
        if problem is not None:
            raise FlagError(f"--system-prompt: {problem}")
        settle_compiler_check()  # before the first prompt: a Ctrl-C is never lost to it
        enable_line_editing()
        run_chat(loop, read=shared_reader(read_line))


def shared_reader(read):
    """``read`` (a line, None at the end of input) that, under ``mlx.launch``, runs on rank 0
    only and sends each line to the other ranks, so every rank runs the same turns."""
    from redrafter_mlx.engine.base.distributed import broadcast_text, world

    group = world()
    if group is None:
        return read
    return lambda prompt: broadcast_text(read(prompt) if group.rank() == 0 else None, group)
