"""The options of a distillation run, what a prepared run holds, and the planning both data
sources share (data order, step count, the settings a checkpoint records, the shortlist).

Shapes: P cached positions, T drafter steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.base.errors import ParamError
from ..engine.verifier.protocol import Verifier
from .data import Sequence
from .evaluation import DEFAULT_EVAL_SHAPES
from .targets import TargetCache
from .training import DataOrder, shortlist_index, shortlist_vocab

TARGET_MODES = ("distill", "self", "ground-truth")
DEFAULT_BUDGET = "45m"
AUTO_DRAFT_VOCAB = 8192  # built-in data: a shortlist head when the vocabulary is 4x larger
# of a time budget: model-written prompts stop, answers stop, training ends
OWN_PROMPT_SHARE, GEN_SHARE, TRAIN_SHARE = 0.1, 0.5, 0.9
MAX_EPOCHS = 3.0  # a time budget trains at most this many epochs over the answers
SELECTIONS = 6  # held-out scores in a run (built-in data), unless select_every is given


@dataclass
class DistillOptions:
    """All options of a run; names match the CLI flags (underscored)."""

    predict_tokens: int = 5
    layers: int = 2
    exit_dim: int | str = "auto"
    rnn: bool = True
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 128
    seq_len: int = 512
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.01
    eval_data: list | None = None
    eval_prompts: int = 8
    eval_max_tokens: int = 64
    eval_shapes: tuple = DEFAULT_EVAL_SHAPES
    resume: bool = False
    overwrite: bool = False
    targets: str | None = None  # None: "distill" with data files, "self" with the built-in data
    save_every: int = 500
    seed: int = 0
    grad_accum: int = 1
    cache_dir: str | None = None
    dtype: str | None = None
    draft_vocab: int | None = None
    soft_targets: bool | None = None  # None: on with the built-in data, else off
    quiet: bool = False
    # the built-in data (no data files): see ``selfdata``
    budget: str | None = None  # "45m", "2h", "200k" positions; None: DEFAULT_BUDGET
    gen_temp: float = 0.0  # answers: 0 greedy, else sampled at this temperature
    answer_tokens: int = 160
    gen_batch: int = 32
    own_prompts: int = 128  # user turns the model writes itself
    val_prompts: int = 16  # built-in prompts held out for selection and the final evaluation
    select_every: int | None = None  # steps between held-out scores; None: SELECTIONS a run
    # what the drafter reads: "auto" (EAGLE-3's low, middle and high layer), "i,j,k" (the
    # residual streams entering those layers, projected: training.resolve_feature_layers) or
    # "last" (the final normed hidden state, every drafter before). Default auto: the
    # SmolLM2 ablation (smollm2_drafter/BUILD.md) at equal data and steps.
    feature_layers: str = "auto"

    def validate(self) -> DistillOptions:
        """Return self, or raise ParamError naming the option and its allowed values."""
        if self.predict_tokens < 1:
            raise ParamError(
                "predict_tokens", f"predicted tokens must be >= 1, got {self.predict_tokens}"
            )
        if self.layers < 0:
            raise ParamError("layers", f"layers must be >= 0, got {self.layers}")
        if self.targets is not None and self.targets not in TARGET_MODES:
            raise ParamError(
                "targets", f"targets must be one of {TARGET_MODES}, got {self.targets!r}"
            )
        if self.steps is not None and self.epochs is not None:
            raise ParamError("epochs", "give either steps or epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ParamError("steps", f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None:
            _check_float("epochs", self.epochs, "> 0", above=0.0)
        _check_float("lr", self.lr, "> 0, e.g. 1e-3", above=0.0)
        _check_float("weight_decay", self.weight_decay, ">= 0, e.g. 0.01", least=0.0)
        if self.lr * self.weight_decay >= 1:
            raise ParamError(
                "weight_decay",
                f"weight decay {self.weight_decay:g} with learning rate {self.lr:g}: AdamW "
                f"multiplies the weights by 1 - lr x weight decay = "
                f"{1 - self.lr * self.weight_decay:g} each step; use a weight decay below "
                f"1/lr = {1 / self.lr:g}",
            )
        _check_float(
            "warmup", self.warmup, ">= 0: a fraction < 1 of the steps or a step count", least=0.0
        )
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ParamError(
                    name, f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ParamError(
                "draft_vocab", f"draft vocab must be >= 1 token ids, got {self.draft_vocab}"
            )
        for name in ("answer_tokens", "gen_batch"):
            if getattr(self, name) < 1:
                raise ParamError(
                    name, f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        if self.own_prompts < 0 or self.val_prompts < 1:
            raise ParamError("val_prompts", "own prompts must be >= 0 and val prompts >= 1")
        _check_float("gen_temp", self.gen_temp, ">= 0 (0: greedy)", least=0.0)
        if self.select_every is not None and self.select_every < 1:
            raise ParamError("select_every", f"select every must be >= 1, got {self.select_every}")
        if self.soft_targets and self.targets != "self":
            raise ParamError(
                "soft_targets",
                "soft targets need --targets self (the model's distribution at a target is "
                "read from the cached hidden state where the data drew it: exact only when the "
                "data is the model's own greedy output)",
            )
        if self.budget is not None:
            from .selfdata import parse_budget

            try:
                kind, amount = parse_budget(self.budget)
            except ValueError as e:
                raise ParamError("budget", str(e)) from None
            batch = self.gen_batch * self.answer_tokens
            if kind == "positions" and amount < batch:
                raise ParamError(
                    "budget",
                    f"--budget {self.budget} asks for {amount:,.0f} answer positions, less than "
                    f"one batch of answers (--gen-batch {self.gen_batch} x --answer-tokens "
                    f"{self.answer_tokens} = up to {batch:,} positions), which the run writes "
                    f"whole; give --budget {math.ceil(batch / 1000)}k or more, a smaller "
                    "--gen-batch, or a time with its unit (30m, 1h)",
                )
        spec = str(self.feature_layers or "last").strip().lower().replace(" ", "")
        if spec not in ("auto", "last") and not all(p.isdigit() for p in spec.split(",")):
            raise ParamError(
                "feature_layers",
                f"feature layers must be auto, last or layer indices like 2,15,27; "
                f"got {self.feature_layers!r}",
            )
        self.feature_layers = spec
        if self.exit_dim != "auto":
            try:
                self.exit_dim = int(self.exit_dim)
            except ValueError:
                raise ParamError(
                    "exit_dim", f"exit dim must be 'auto' or an integer, got {self.exit_dim!r}"
                ) from None
        return self

    # ------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------------------
    # the run

    def for_data(self, builtin: bool) -> DistillOptions:
        """Fill the defaults that depend on the data: the built-in data is the model's own
        answers (``targets="self"``, soft targets on, a budget); data files default to
        rollouts and take no budget. Raises ParamError on a combination that cannot work."""
        if builtin:
            if self.targets not in (None, "self"):
                raise ParamError(
                    "targets",
                    "the built-in data is the model's own answers, so its targets are 'self'; "
                    f"--targets {self.targets} needs --data",
                )
            self.targets = "self"
            self.soft_targets = True if self.soft_targets is None else self.soft_targets
            self.budget = self.budget or DEFAULT_BUDGET
        else:
            if self.budget is not None:
                raise ParamError(
                    "budget",
                    "--budget sizes the built-in data (no --data); with --data use --steps "
                    "or --epochs",
                )
            self.targets = self.targets or "distill"
            self.soft_targets = bool(self.soft_targets)
        return self.validate()


def _check_float(name: str, value: float, allowed: str, above=None, least=None) -> None:
    """ParamError naming ``name`` unless ``value`` is a finite number > ``above`` (or >=
    ``least``): NaN, infinities and out-of-range values are refused with what is allowed."""
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (least is None or value >= least)
    if not ok:
        flag = name.replace("_", " ")
        raise ParamError(name, f"{flag} must be a finite number {allowed}, got {value}")


class NullProgress:
    """What the run reports progress to when the caller shows nothing (the CLI passes bars).

    ``start(name, total, unit)``, ``update(advance, **metrics)``, ``stop()``, ``note(text)``
    and ``table(results, title)`` (eval results: tokens/step per beam shape)."""

    def start(self, name: str, total: float, unit: str = "") -> None:
        pass

    def update(self, advance: float = 1, **metrics) -> None:
        pass

    def stop(self) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def table(self, results: list[dict], title: str) -> None:
        pass


@dataclass
class RunContext:
    model: Verifier
    tokenizer: object
    model_dir: Path
    out: Path
    cache: TargetCache
    order: DataOrder
    total_steps: int
    sequences: list[Sequence]
    run: dict = field(default_factory=dict)
    draft_vocab: list[int] | None = None
    eval_prompts: list[list[int]] | None = None  # held-out prompts (built-in data)
    validation: dict | None = None  # held-out answers for checkpoint selection
    select_every: int = 0


def training_order(cache: TargetCache, opts: DistillOptions, world: int) -> DataOrder:
    """The data order of this process (rank set by the caller)."""
    return DataOrder(
        cache.size, min(opts.batch_size, cache.size // world or 1), opts.seed, 0, world
    )


def planned_steps(opts: DistillOptions, order: DataOrder, epochs: float) -> int:
    """``steps`` when given, else ``epochs`` over the cached positions."""
    if opts.steps is not None:
        return opts.steps
    return max(1, math.ceil(epochs * order.per_epoch / opts.grad_accum))


def run_record(opts: DistillOptions, key: str, order: DataOrder, total: int, world: int) -> dict:
    """The settings a checkpoint records; a resumed run must match them."""
    run = dict(
        cache_key=key,
        predict_tokens=opts.predict_tokens,
        layers=opts.layers,
        exit_dim=opts.exit_dim,
        rnn=opts.rnn,
        targets=opts.targets,
        batch_size=order.batch_size,
        grad_accum=opts.grad_accum,
        lr=opts.lr,
        warmup=opts.warmup,
        weight_decay=opts.weight_decay,
        seed=opts.seed,
        total_steps=total,
        seq_len=opts.seq_len,
        world_size=world,
    )
    if opts.soft_targets:  # only when on: runs checkpointed before the option still resume
        run["soft_targets"] = True
    if opts.feature_layers != "last":  # likewise (a run before the option read the last)
        run["feature_layers"] = opts.feature_layers
    return run


def check_draft_vocab(size: int | None, vocab_size: int) -> None:
    """ParamError unless ``--draft-vocab`` (None: not given) fits the model's vocabulary."""
    if size is not None and size > vocab_size:
        raise ParamError(
            "draft_vocab",
            f"{size} ids exceed the model's vocabulary ({vocab_size} ids); use fewer (the "
            "shortlist is a part of the vocabulary), or leave --draft-vocab out",
        )


def choose_shortlist(sequences, size, model: Verifier, tokenizer, cache, progress):
    """The shortlist head ids (``size`` most frequent training tokens), or None."""
    if not size:
        return None
    check_draft_vocab(size, model.vocab_size)
    vocab = shortlist_vocab(sequences, size, model.vocab_size, sorted(tokenizer.eos_token_ids))
    covered = shortlist_index(vocab, model.vocab_size)[cache.tokens[:, 1:]] >= 0
    share = float((covered & cache.valid).sum() / max(int(cache.valid.sum()), 1))
    progress.note(f"shortlist: {len(vocab)} ids cover {share:.1%} of the training targets")
    return vocab
