"""A run of the batched loop, built one way for each of its clients: ``generate_steps`` (one
call's rows, ``engine/loop/generation.py``) and the server's ``Scheduler`` (requests that come
and go, ``serve/scheduler.py``).

``Run.of`` checks the draft sources against the model and resolves the shape to the parts
they can run (``BeamShape.runnable``; a source no part uses is dropped); ``Run.policy``
chooses each step's shape (``batch_choice.ShapePolicy``) by how the run's rows come and go;
``Run.generator`` makes the ``BatchGenerator`` over them. ``make_row`` makes a request's
row: its token limit and why it stops there (``cache.token_limit``: ``"length"`` at the
request's ``max_tokens``, ``"context"`` where the model's context ends first), with its
branch tree when branching is on.

The draft slot's checks (``held.check_draft_slot``, ``check_loaded``) are called from this
module alone, and it is the boundary where the drafter and the draft slot become the run's
``sources`` (``held.held_sources``, once): the loop below takes only that tuple.

The checks a run makes before anything runs live here too: the API's sources and pinned
shape (``check_api_sources``, ``check_shape_sources``, ``missing_sources``), the prompts
(``check_prompts``), the branching rules (``resolve_branches``) and a branching run's memory
(``check_branch_memory``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..base.errors import ParamError
from ..core.branches import BRANCH_MODES, BranchRules, branch_rules, request_rows
from ..core.sampling import SamplerConfig
from ..core.shape import AR, BeamShape
from ..decoding.cache import token_limit
from ..drafting.held import (
    check_draft_slot,
    check_loaded,
    check_sources,
    held_modules,
    held_sources,
    runnable_sources,
)
from ..drafting.sources import Source
from ..verifier.protocol import Verifier
from .adaptive import Adaptive
from .batch import BatchGenerator
from .batch_choice import BatchChoice, FixedShape, ShapePolicy, SoloChoice, learnt_batch
from .loading import materialize
from .memory import check_step_memory
from .rows import Row, RowStats

# How a run's rows come and go (``Run.policy``):
#   "fixed":    one call's rows, joining together and only leaving (``generate_steps``)
#   "branches": one call's rows whose branches join as rows of their own (APAR)
#   "requests": the server's rows, a request joining whenever a row is free
ROW_KINDS = ("fixed", "branches", "requests")


def check_slot_loaded(draft_model) -> None:
    """TypeError unless the draft slot holds something loaded (``held.check_loaded``:
    a path names how to load it); None passes."""
    if draft_model is not None:
        check_loaded(draft_model)


@dataclass(frozen=True)
class Run:
    """The sources a run decodes with and the shape they run. ``shape``: the requested shape
    less the parts without a source (``BeamShape.runnable``); ``sources``: the drafter and
    draft slots resolved once (``held.held_sources``), less those no part of ``shape`` runs
    (``held.runnable_sources``)."""

    model: Any
    shape: BeamShape
    sources: tuple[Source, ...] = ()

    @classmethod
    def of(cls, model, drafter, draft_model, shape: BeamShape | None, *, own_thread=False) -> Run:
        """The checked and resolved sources of a run of ``shape`` (None: plain decoding, which
        takes no drafter). The draft slot is checked against the model
        (``held.check_draft_slot``: TypeError for a path, ValueError naming the fix), then
        the slots become the run's sources (``of_sources``)."""
        if shape is None and drafter is not None:
            raise ValueError(
                "a drafter needs a beam shape: pass one (e.g. BeamShape(4, 4)), or "
                "drafter=None for plain decoding"
            )
        check_slot_loaded(draft_model)  # a path: how to load it (before resolving it)
        sources = held_sources(drafter, draft_model)  # the one resolution of the two slots
        check_draft_slot(model, draft_model, sources)  # a model, an early-exit adapter or both
        return cls.of_sources(model, sources, shape, own_thread=own_thread)

    @classmethod
    def of_sources(
        cls, model, sources: tuple[Source, ...], shape: BeamShape | None, *, own_thread=False
    ) -> Run:
        """A run of ``shape`` (None: plain decoding) over ``sources`` (``held.held_sources``):
        ``shape`` checked against the vocabulary (``BeamShape.validate``: ``ShapeError``) and
        cut to the parts the sources run. A drafter trained on other feature layers than the
        model taps sets the model's (``Verifier.capture_features``, as ``loading.attach``
        does). ``own_thread``: the loop runs on another thread than the one that loaded the
        modules (the server's engine thread): every array they hold is evaluated now
        (``loading.materialize``)."""
        check_sources(sources)
        parts = {source.part for source in sources}
        shape = (AR if shape is None else shape).validate(model.vocab_size)
        shape = shape.runnable("beams" in parts, "chain" in parts)
        sources = runnable_sources(sources, shape)
        layers = next((s.feature_layers for s in sources if s.feature_layers), None)
        if layers and tuple(layers) != model.feature_layers:
            model.capture_features(layers)
        if own_thread:
            materialize(model, *held_modules(sources))  # an adapter's rope tables too
        return cls(model, shape, sources)

    @property
    def speculative(self) -> bool:
        """Whether the run drafts (its shape is not plain decoding)."""
        return not self.shape.is_autoregressive

    def policy(
        self, adapt: Adaptive | bool, rows: str, sampler: SamplerConfig | None = None
    ) -> ShapePolicy:
        """Each step's shape: ``shape`` pinned (``FixedShape``) unless ``adapt`` and the run
        drafts; else by ``rows`` (``ROW_KINDS``): ``"fixed"``, one process's choice
        (``SoloChoice``, over ``sampler``'s draws); ``"branches"`` and ``"requests"``, a choice
        per batch size (``BatchChoice``) with ``adapt``'s settings, or for ``adapt=True`` the
        defaults: a branching call's kept on the model for its configuration
        (``learnt_batch``: the next call starts from what this one measured), a server's its
        own for its life."""
        if rows not in ROW_KINDS:
            raise ValueError(f"rows must be one of {ROW_KINDS}, got {rows!r}")
        if not adapt or not self.speculative:
            return FixedShape(self.shape)
        if rows == "fixed":
            return SoloChoice(self.model, self.sources, self.shape, sampler, adapt)
        if isinstance(adapt, Adaptive):
            return BatchChoice(self.shape, adapt)
        if rows == "branches":
            return learnt_batch(self.model, self.sources, self.shape, sampler)
        return BatchChoice(self.shape, Adaptive())

    def generator(
        self,
        policy: ShapePolicy,
        eos=(),
        max_batch: int = 8,
        *,
        compiled: bool = True,
        group=None,
        release: bool = True,
        kind: type[BatchGenerator] = BatchGenerator,
    ) -> BatchGenerator:
        """The batched loop over this run's sources (``kind``: ``BatchGenerator`` or a
        subclass, such as the server's ``RequestBatch``), its arguments as
        ``BatchGenerator``'s."""
        return kind(self.model, self.sources, policy, eos, max_batch, compiled, group, release)


def make_row(
    model,
    sampler: SamplerConfig,
    prompt_len: int,
    max_tokens: int,
    branches: BranchRules | None = None,
    owner: Any = None,
) -> Row:
    """The row of one request of ``prompt_len`` prompt tokens answering up to ``max_tokens``:
    its limit and ``at_limit`` from ``cache.token_limit`` (what is left of the model's context
    when that is less: ``"context"``), with branching on (``branches``) its request's
    ``BranchTree`` and a row's share of the answer (``branches.request_rows``); ``owner``:
    the client's handle."""
    row_tokens, tree = request_rows(branches, max_tokens)
    limit, at_limit = token_limit(model, prompt_len, row_tokens)
    stats = RowStats(prompt_len)
    return Row(sampler, limit, prompt_len, stats, owner, at_limit=at_limit, tree=tree)


def check_branch_memory(model, sources, shape, rows, max_batch, longest, sampler):
    """``check_step_memory`` for ``max_batch`` rows (``rows`` prompts, each up to its branch
    limit); when the prompts alone fit, the branch limit is what does not: ``ShapeTooLarge``
    (a ``ParamError``) naming ``max_branches`` (the flag), not the shape's largest part."""
    from .memory import ShapeTooLarge

    sampling = not sampler.greedy
    try:
        check_step_memory(model, sources, shape, max_batch, longest, sampling)
    except ShapeTooLarge as e:
        if max_batch == rows:
            raise
        try:
            check_step_memory(model, sources, shape, rows, longest, sampling)
        except ShapeTooLarge:
            raise e from None
        raise ShapeTooLarge(
            "max_branches",
            f"{max_batch // rows} branches per answer make up to {max_batch} rows, and "
            f"{e.message.split('; ')[0]}; lower --max-branches (each branch is a row)",
        ) from None


def resolve_branches(tokenizer, branches, **limits) -> BranchRules | None:
    """The branching rules of ``branches`` (``"auto"`` / ``"on"`` / ``"off"``, or
    ``BranchRules`` / None as is) for the model whose tokenizer folder is
    ``tokenizer.path`` (``branches.branch_rules``, with ``limits``: ``max_depth``,
    ``max_branches``); without a folder, ``"auto"`` is off."""
    if branches is None or isinstance(branches, BranchRules):
        return branches
    folder = getattr(tokenizer, "path", None)
    if folder is not None:
        return branch_rules(folder, branches, **limits)
    if branches not in BRANCH_MODES:
        return branch_rules(".", branches)  # the ParamError naming the modes
    if branches == "on":
        raise ParamError(
            "branches",
            "branches='on' needs the model's tokenizer folder (its split tokens); pass the "
            "tokenizer of an APAR model, or BranchRules, or branches='off'",
        )
    return None


def missing_sources(shape: BeamShape, has_drafter: bool, has_draft_model: bool) -> list[str]:
    """The draft sources a pinned ``shape``'s parts need that a run lacks: ``"drafter"``
    for its beams (``W×L``), ``"draft model"`` for its draft model's chain (``D1×L``); the
    lookup chains need none. A run would drop such a part (``BeamShape.runnable``), so the
    API and the CLI refuse the shape instead (``check_shape_sources``, bench ``--configs``)."""
    missing = []
    if shape.drafts and not shape.is_autoregressive and not has_drafter:
        missing.append("drafter")
    if shape.model_length and not has_draft_model:
        missing.append("draft model")
    return missing


def check_shape_sources(shape: BeamShape | None, drafter, draft_model) -> None:
    """ParamError (``shape``) when a pinned ``shape`` (None: the default plan, which
    follows the sources) has a part whose source was not given (``missing_sources``),
    naming the part and the fix, before anything runs."""
    if shape is None:
        return
    missing = missing_sources(shape, drafter is not None, draft_model is not None)
    if "drafter" in missing:
        raise ParamError(
            "shape",
            f"shape {shape.label} has drafter beams (W{shape.width}×L{shape.length}) but "
            "drafter is None: pass a drafter (redrafter_mlx.load(model_path, drafter_path)), "
            "or a shape without its W part (lookup alone: K1xL8; plain decoding: "
            "BeamShape.autoregressive())",
        )
    if "draft model" in missing:
        raise ParamError(
            "shape",
            f"shape {shape.label} has a draft model's chain (D1×L{shape.model_length}) but "
            "draft_model is None: pass one (model, drafter, tokenizer, draft = "
            "redrafter_mlx.load(model_path, drafter_path, draft_model=path); "
            "draft_model=draft), or a shape without its D part",
        )


def check_drafter(drafter) -> None:
    """TypeError when ``drafter`` is a path, not a loaded drafter: how to load it."""
    if isinstance(drafter, str | os.PathLike):
        raise TypeError(
            f"drafter takes a loaded drafter or None, got the path {str(drafter)!r}; load it "
            f"first: model, drafter, tokenizer = redrafter_mlx.load(model_path, "
            f"{str(drafter)!r})"
        )


def check_prompts(model: Verifier, prompts: list[list[int]], max_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    V = model.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
    context = model.max_context
    if context is not None:
        longest = max(len(p) for p in prompts)
        if longest >= context:
            raise ValueError(
                f"prompt of {longest} tokens does not fit the model's context of {context} "
                f"tokens; shorten the prompt"
            )


def check_api_sources(drafter, draft_model, shape: BeamShape | None) -> None:
    """The API entry's checks of the draft sources, before anything runs: loaded, not paths
    (``check_drafter``, ``run.check_slot_loaded``), and every part of a pinned ``shape``
    given its source (``check_shape_sources``)."""
    check_drafter(drafter)
    check_slot_loaded(draft_model)  # the rest of its checks: ``generate_steps`` (``Run.of``)
    check_shape_sources(shape, drafter, draft_model)
