"""Shared pieces of the chat / generate / serve / bench commands.

* flag validation (a bad value is one red line and exit code 2, ``errors.py``);
* loading the model that ``paths.py`` resolved (``--model``, else a bundled model);
* the beam shape: the flags mapped onto the engine's plan (``engine/loop/plan.py``);
* ``prepare_engine``: those steps, in one order, for chat, generate, serve and bench.

The option types live in ``options.py``, the error path in ``errors.py``, the stats line in
``stats.py``: commands import each from its own module. Only the standard library, the CLI's
own light modules and the engine's plan arguments (``BeamFlags``' base) are imported at module
level so ``--help`` is fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redrafter_mlx.engine.core.sampling import SamplerConfig
    from redrafter_mlx.engine.core.shape import BeamShape
    from tuning import ShapeChoice

from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.cli.errors import FlagError, flag_for
from redrafter_mlx.cli.options import (
    DTYPES,
    MIN_KV_SIZE,
    BranchFlags,
    SamplingFlags,
    ShapeFlags,
)
from redrafter_mlx.cli.paths import ModelPaths, resolve_draft_model, resolve_paths

# --------------------------------------------------------------------------- flag validation


def sampling_fields(flags: SamplingFlags) -> dict:
    """The sampling flags as typed, as ``SamplerConfig`` fields (None: not given, the model's
    default fills it); ``--logit-bias`` parsed (FlagError when it cannot be)."""
    return dict(
        temperature=flags.temp,
        top_p=flags.top_p,
        top_k=flags.top_k,
        min_p=flags.min_p,
        seed=flags.seed,
        repetition_penalty=flags.repetition_penalty,
        repetition_context_size=flags.repetition_context_size,
        logit_bias=parse_logit_bias(flags.logit_bias),
    )


def describe_sampling(sampler: SamplerConfig, given=(), origin: str = "") -> str:
    """``temp 0.2 · top-p 0.9 (generation_config.json)``: the values in force and whence
    (``given``: the fields set by flags; ``origin``: where the others came from, if not the
    engine's defaults)."""
    from redrafter_mlx.engine.core.sampling import MODEL_DEFAULT_KEYS

    greedy = sampler.greedy
    parts = ["greedy"] if greedy else [f"temp {sampler.temperature:g}"]
    if not greedy:
        parts += [f"top-p {sampler.top_p:g}"] if sampler.top_p < 1 else []
        parts += [f"top-k {sampler.top_k}"] if sampler.top_k else []
        parts += [f"min-p {sampler.min_p:g}"] if sampler.min_p else []
    if sampler.repetition_penalty != 1.0:
        parts.append(
            f"repetition penalty {sampler.repetition_penalty:g} over "
            f"{sampler.repetition_context_size} tokens"
        )
    if sampler.logit_bias:
        parts.append(f"logit bias on {len(sampler.logit_bias)} tokens")
    if origin and set(MODEL_DEFAULT_KEYS) - set(given):
        whence = "model's " + origin + (", flags" if given else "")
    else:
        whence = "flags" if given else "default"
    return " · ".join(parts) + f" ({whence})"


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


def kv_capped(model) -> bool:
    """Whether ``--max-kv-size``, not the model's trained context, bounds a row's tokens."""
    cap = getattr(model, "context_cap", None)
    trained = model.args.max_position_embeddings
    return cap is not None and (trained is None or cap < trained)


def context_limit(model) -> str:
    """What bounds a row's tokens, in words: ``the model's context of N tokens``, or ``the
    --max-kv-size cap of N tokens`` when that cap is below the model's context."""
    if kv_capped(model):
        return f"the --max-kv-size cap of {model.max_context:,} tokens"
    return f"the model's context of {model.max_context:,} tokens"


def check_prompt_fits(model, prompt_tokens: int) -> None:
    """ValueError naming the limit (``context_limit``) and its fix when a prompt of
    ``prompt_tokens`` leaves no room for an answer."""
    context = model.max_context
    if context is None or prompt_tokens < context:
        return
    fix = "raise --max-kv-size or shorten the prompt" if kv_capped(model) else "shorten the prompt"
    raise ValueError(
        f"prompt of {prompt_tokens:,} tokens does not fit {context_limit(model)}; {fix}"
    )


def check_length(length: int) -> None:
    """FlagError unless ``--beam-length`` counts the init token and one draft."""
    if length < 2:
        raise FlagError(
            f"--beam-length must be >= 2 (it counts the init token), got {length}; "
            f"use --no-draft for plain decoding"
        )


def check_shape(shape: BeamShape, flag: str | None = None) -> BeamShape:
    """Validate a speculative beam shape with the engine's rules; ``flag``: the one flag
    that gave the whole shape (``--grid``), named in the error instead of the field's."""
    from redrafter_mlx.engine.core.shape import ShapeError

    if flag is None:
        check_length(shape.length)
    try:
        return shape.validate()  # a ShapeError names its field: cli_errors names the flag
    except ShapeError as e:
        if flag is None:
            raise
        where = f"{flag} {shape.width}x{shape.length}"
        if e.param == "capacity":
            where = f"--capacity with {where}"
        raise FlagError(f"{where}: {e.message}") from None


def plan_from_flags(paths: ModelPaths, dtype: str | None, beam: BeamFlags) -> ShapeChoice:
    """The plan of these flags (``engine.loop.plan.resolve_plan``, with the tuned profiles);
    a warning when --beam-length asks for more than the drafter was trained for."""
    from redrafter_mlx.engine.loop.plan import resolve_plan
    from tuning.defaults import ProfileSources

    if beam.length is not None:
        check_length(beam.length)
    plan = resolve_plan(
        paths.model,
        paths.drafter,
        dtype,
        beam,
        ProfileSources(),
        demo=paths.demo,
        draft_model=paths.draft_model,
    )
    if beam.asks_beam and plan.shape.drafts:
        warn_untrained_length(plan.shape, paths.drafter)
    return plan


def warn_untrained_length(shape: BeamShape, drafter: str | None) -> None:
    """Warn when --beam-length asks for more draft steps than the drafter was trained for."""
    from redrafter_mlx.engine.loop.plan import max_length_for, read_predict_tokens

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
    # --draft-model, loaded: the draft slot (a draft model, the model itself when it names
    # it, an early-exit adapter, or both as a (draft model, adapter) tuple when it was given twice)
    draft_model: object = None


def load_engine(paths: ModelPaths, dtype: str | None, with_drafter: bool = True) -> Engine:
    """Load the model (and the drafter when ``with_drafter``); LoadError on any problem.

    Under ``mlx.launch`` (several processes) each loads its shard of the model
    (``engine/base/distributed.py``) and the whole drafter; only rank 0 prints.
    """
    from redrafter_mlx import load
    from redrafter_mlx.engine.base.distributed import world
    from redrafter_mlx.engine.base.platform import fit_blas_threads

    group = world()
    follow_rank0(group)
    for note in paths.notes:
        err_console().print(note, style="dim")
    drafter_path = paths.drafter if with_drafter else None
    from redrafter_mlx.engine.loop.loading import resolve_path

    if paths.draft_model is not None:
        model, drafter, tokenizer, draft = load(
            paths.model, drafter_path, dtype, group, draft_model=paths.draft_model
        )
    else:
        model, drafter, tokenizer = load(paths.model, drafter_path, dtype, group)
        draft = None
    fit_blas_threads(model, drafter)
    folder = resolve_path(paths.model)
    return Engine(model, drafter, tokenizer, paths, dtype_name(model), folder, draft)


def _plan_args():
    from redrafter_mlx.engine.loop.plan import PlanArgs

    return PlanArgs


class BeamFlags(_plan_args()):
    """``--beam-width``, ``--beam-length``, ``--capacity``, ``--no-draft``, ``--lookup``,
    ``--lookup-length`` and ``--no-lookup`` as given: the engine's ``PlanArgs``, its errors
    named by the flags."""

    @classmethod
    def of(cls, flags: ShapeFlags) -> BeamFlags:
        """The plan arguments of a command's beam-shape flags."""
        return cls(
            flags.beam_width,
            flags.beam_length,
            flags.capacity,
            flags.no_draft,
            flags.lookup,
            flags.lookup_length,
            flags.no_lookup,
        )

    def lookup_chains(self) -> tuple[int, int]:
        """(chains, chain length) asked for, defaults filled in; FlagError when invalid."""
        from redrafter_mlx.engine.base.errors import ParamError

        if self.no_lookup and self.lookup:
            raise FlagError(f"--no-lookup contradicts --lookup {self.lookup}; give one of them")
        try:
            return super().lookup_chains()
        except ParamError as e:  # "lookup_length must be ..." -> "--lookup-length must be ..."
            raise FlagError(flag_for(e.param) + e.message[len(e.param) :]) from None


@dataclass
class Prepared:
    """What :func:`prepare_engine` set up: the loaded engine, its plan and the checked flags."""

    engine: Engine
    plan: Any  # a ShapeChoice, or what the command's ``choose`` returned
    sampling: SamplerConfig | None  # None when no sampling flags were given
    checked: Any = None  # what the command's ``check`` returned
    sampling_origin: str = ""  # where settings no flag gave came from ("": the engine)
    sampling_note: str = ""  # ``describe_sampling``: the values in force and whence


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
    draft_model: str | list[str] | None = None,
) -> Prepared:
    """The set-up of chat, generate, serve and bench: check the flags, resolve, plan, load.

    In this order (the first bad flag is the one reported): the sampling flags
    (``sampling_fields``), ``--max-tokens``, ``--dtype``, the command's own
    ``check()`` (its result is ``Prepared.checked``), the model and drafter paths, the beam
    plan (``plan_from_flags`` from ``beam``, or the command's ``choose(paths) -> (plan,
    speculative)``), then loading, with the drafter only when the plan speculates.
    ``--no-draft`` with ``--draft-model`` is refused before any path is resolved (plain
    decoding drafts nothing; bench's ``choose`` may run the draft model's shapes without
    the drafter).
    Sampling settings not given by a flag then take the model's ``generation_config.json``
    values (``model_defaults``; bench keeps the engine's greedy default), and logit-bias ids
    are checked against the vocabulary. Last, a step of the plan's shape over ``batch`` rows
    must fit in memory. Under ``mlx.launch`` the model is split across the ranks
    (``load_engine``), which a command must say it handles (``split_ok``). ``draft_model``:
    ``--draft-model`` (one value or two: a draft model and an early-exit adapter's folder),
    loaded beside the model (the plan's shape gains its ``D1×L`` part).
    """
    from redrafter_mlx.engine.base.distributed import world

    group = world()
    if group is not None and not split_ok:
        raise ValueError(
            "this command does not run under mlx.launch yet (chat, generate, bench, serve and "
            "tune do); start it as one process"
        )
    follow_rank0(group)
    from redrafter_mlx.engine.core.sampling import SamplerConfig

    typed = sampling_fields(sampling) if sampling is not None else None
    sampler = SamplerConfig.resolve(typed) if typed is not None else None
    check_limits(max_tokens, max_kv_size, dtype)
    if beam.no_draft and draft_model and choose is None:
        raise FlagError(
            f"--no-draft decodes plainly, so --draft-model "
            f"{' '.join(draft_model) if isinstance(draft_model, list) else draft_model} would "
            "load for nothing; drop --draft-model for plain decoding, or --no-draft to draft "
            "with it"
        )
    checked = check() if check is not None else None
    paths = resolve_paths(model, drafter)
    if draft_model is not None:
        paths = replace(paths, draft_model=resolve_draft_model(draft_model))
    if choose is None:
        plan = same_plan_everywhere(plan_from_flags(paths, dtype, beam))
        speculative = plan.speculative
    else:
        plan, speculative = choose(paths)
    engine = load_engine(paths, dtype, with_drafter=speculative)
    engine.model.cap_context(max_kv_size)
    if engine.draft_model is not None and hasattr(plan, "shape") and not beam.no_draft:
        plan = with_draft_model(plan, engine.drafter is not None, beam.length)
        if not plan.shape.model_length:  # tuned with it: its chain did not pay here
            engine.draft_model = None
    origin, note = "", ""
    if sampler is not None:
        sampler, origin, note = settle_sampling(engine, sampler, typed, model_defaults)
    if hasattr(plan, "shape"):  # a ShapeChoice: refuse a step that cannot fit, before compiling
        sampled = sampler is None or not sampler.greedy  # serve's rows may sample
        check_memory(engine, plan.shape, max_tokens, sampled, batch)
    return Prepared(engine, plan, sampler, checked, origin, note)


def check_limits(max_tokens: int | None, max_kv_size: int | None, dtype: str | None) -> None:
    """FlagError naming ``--max-tokens``, ``--max-kv-size`` or ``--dtype``, the first that is
    bad (None: not given)."""
    if max_tokens is not None:
        check_max_tokens(max_tokens)
    if max_kv_size is not None and max_kv_size < MIN_KV_SIZE:
        raise FlagError(f"--max-kv-size must be >= {MIN_KV_SIZE} tokens, got {max_kv_size}")
    check_dtype(dtype)


def settle_sampling(engine: Engine, sampler: SamplerConfig, typed: dict, model_defaults: bool):
    """(the sampler, where the settings no flag gave came from, ``describe_sampling``'s note):
    with ``model_defaults``, the model's ``generation_config.json`` fills what no flag set;
    logit-bias ids are checked against the vocabulary."""
    from redrafter_mlx.engine.core.sampling import GENERATION_CONFIG, MODEL_DEFAULT_KEYS
    from redrafter_mlx.engine.core.sampling import model_defaults as defaults_of

    given = {k for k, v in typed.items() if v is not None and k in MODEL_DEFAULT_KEYS}
    origin = ""
    if model_defaults:
        found = {k: v for k, v in defaults_of(engine.folder).items() if k not in given}
        sampler = sampler.with_defaults(found, given)
        origin = GENERATION_CONFIG if found else ""
    sampler.validate(engine.model.vocab_size)
    return sampler, origin, describe_sampling(sampler, given, origin)


def with_draft_model(plan, has_drafter: bool, length: int | None):
    """The plan's shape with a draft model's chain (``BeamShape.runnable``); a plan of plain
    decoding (no drafter, no lookup, or tuning found AR faster) becomes the chain alone, of
    ``--beam-length`` tokens, else ``DEFAULT_MODEL_LENGTH``. A plan tuned with this draft
    model (``ShapeChoice.draft_tuned``) stands as tuned: with its chain, or without it (the
    chain did not pay there: the run leaves the draft model out)."""
    from redrafter_mlx.engine.core.shape import DEFAULT_MODEL_LENGTH, BeamShape

    if plan.draft_tuned:
        if plan.shape.model_length:
            return plan
        why = "its chain did not pay here: running without the draft model"
        return replace(plan, source=f"{plan.source}; {why}")
    if plan.speculative:
        shape = plan.shape.runnable(has_drafter, True)
    else:
        shape = BeamShape(0, 1, None, 0, 0, length or DEFAULT_MODEL_LENGTH).validate()
    return replace(plan, shape=shape, source=f"{plan.source}, with --draft-model")


def same_plan_everywhere(plan):
    """Under ``mlx.launch``, rank 0's beam shape on every rank (each host may hold its own
    tuning profile, but the ranks must run one compiled step); ``plan`` alone."""
    from dataclasses import replace

    from redrafter_mlx.engine.base.distributed import broadcast_text, world
    from redrafter_mlx.engine.core.shape import BeamShape

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
    from redrafter_mlx.engine.drafting.held import held_sources
    from redrafter_mlx.engine.loop.memory import check_step_memory

    tokens = 64 + (max_tokens or 256)
    sources = held_sources(engine.drafter, engine.draft_model)  # the boundary: once
    check_step_memory(engine.model, sources, shape, batch, tokens, sampling)


def dtype_name(model) -> str:
    """The float dtype the model's weights were loaded in (``float32``...)."""
    import mlx.core as mx

    dt = model.dtype
    for name in DTYPES:
        if dt == getattr(mx, name):
            return name
    return str(dt)


def branch_flags(engine: Engine, flags: BranchFlags):
    """``--branches MODE`` with ``--branch-depth`` / ``--max-branches`` for the loaded model:
    its ``BranchRules``, or None when branching is off (``run.resolve_branches``; a
    ParamError says what is missing and the fix)."""
    from redrafter_mlx.engine.loop.run import resolve_branches

    mode, depth, most = flags.branches, flags.branch_depth, flags.max_branches
    limits = {k: v for k, v in (("max_depth", depth), ("max_branches", most)) if v is not None}
    rules = resolve_branches(engine.tokenizer, mode, **limits)
    if rules is None and limits:  # a limit on branches that never happen: say so
        flag = "--max-branches" if most is not None else "--branch-depth"
        value = most if most is not None else depth
        why = (
            "--branches off turns branching off"
            if mode == "off"
            else "this model does not branch (its config.json has no branches block: not an "
            "APAR model)"
        )
        raise FlagError(f"{flag} {value} limits APAR branches, but {why}; drop {flag}")
    return rules
