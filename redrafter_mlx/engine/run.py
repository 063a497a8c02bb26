"""A run of the batched loop, built one way for each of its clients: ``generate_steps`` (one
call's rows, ``engine/generation.py``) and the server's ``Scheduler`` (requests that come
and go, ``serve/scheduler.py``).

``Run.of`` checks the draft sources against the model and resolves the shape to the parts
they can run (``BeamShape.runnable``; a source no part uses is dropped); ``Run.policy``
chooses each step's shape (``batch_choice.ShapePolicy``) by how the run's rows come and go;
``Run.generator`` makes the ``BatchGenerator`` over them. ``make_row`` makes a request's
row: its token limit and why it stops there (``cache.token_limit``: ``"length"`` at the
request's ``max_tokens``, ``"context"`` where the model's context ends first), with its
branch tree when branching is on.

The draft slot's checks (``held.check_draft_slot``, ``check_loaded``,
``slot_modules``) are called from this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .adaptive import Adaptive
from .batch import BatchGenerator
from .batch_choice import BatchChoice, FixedShape, ShapePolicy, SoloChoice, learnt_batch
from .branches import BranchRules, request_rows
from .cache import token_limit
from .held import check_draft_slot, check_loaded, slot_modules
from .loading import materialize
from .rows import Row, RowStats
from .sampling import SamplerConfig
from .shape import AR, BeamShape

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
    less the parts without a source (``BeamShape.runnable``); ``drafter``: None when no part
    of ``shape`` drafts with it; ``draft_model``: the draft slot (``held.slot_items``), None
    when ``shape`` has no ``D1×L`` chain."""

    model: Any
    shape: BeamShape
    drafter: Any = None
    draft_model: Any = None

    @classmethod
    def of(cls, model, drafter, draft_model, shape: BeamShape | None, *, own_thread=False) -> Run:
        """The checked and resolved sources of a run of ``shape`` (None: plain decoding, which
        takes no drafter). The draft slot is checked against the model
        (``held.check_draft_slot``: TypeError for a path, ValueError naming the fix);
        ``shape`` against the vocabulary (``BeamShape.validate``: ``ShapeError``). A drafter
        trained on other feature layers than the model taps sets the model's
        (``Model.capture_features``, as ``loading.attach`` does). ``own_thread``: the loop
        runs on another thread than the one that loaded the modules (the server's engine
        thread): every array they hold is evaluated now (``loading.materialize``)."""
        if shape is None:
            if drafter is not None:
                raise ValueError(
                    "a drafter needs a beam shape: pass one (e.g. BeamShape(4, 4)), or "
                    "drafter=None for plain decoding"
                )
            shape = AR
        check_draft_slot(model, drafter, draft_model)  # a model, an early-exit adapter or both
        shape = shape.validate(model.vocab_size).runnable(
            drafter is not None, draft_model is not None
        )
        draft_model = draft_model if shape.model_length else None
        drafter = drafter if shape.drafts else None
        layers = getattr(getattr(drafter, "args", None), "feature_layers", None)
        if layers and tuple(layers) != model.feature_layers:
            model.capture_features(layers)
        if own_thread:
            materialize(model, drafter, *slot_modules(draft_model))  # an adapter's rope tables too
        return cls(model, shape, drafter, draft_model)

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
            return SoloChoice(self.model, self.drafter, self.shape, sampler, adapt)
        if isinstance(adapt, Adaptive):
            return BatchChoice(self.shape, adapt)
        if rows == "branches":
            return learnt_batch(self.model, self.drafter, self.shape, sampler)
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
        return kind(
            self.model,
            self.drafter,
            policy,
            eos,
            max_batch,
            compiled,
            group,
            release,
            draft_model=self.draft_model,
        )


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
