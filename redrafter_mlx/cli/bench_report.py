"""Benchmark logic behind ``redrafter-mlx bench``: AR vs ReDrafter (vs mlx-lm) on prompt sets.

Every configuration gets one warm-up run, then the timed runs are interleaved per prompt
(prompt 1: AR, cfg1, cfg2, ...; prompt 2: ...) so machine noise hits all configurations
alike. A prompt may have a second turn (the conversation so far, with the model's own first
answer): it runs right after the first and is summarised apart, one set of rows per turn.
Speedup is paired: each configuration's total decode tokens / total decode time over the
same prompts (of the same turn), divided by AR's. Greedy runs must reproduce AR's tokens
exactly; any difference is a mismatch, reported per prompt and turn, and checked for a
near-tie that float rounding decided (``measure.near_tie``; the bench fails on any other).
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redrafter_mlx.cli.stats import branch_stats
from redrafter_mlx.engine.base.errors import RedrafterError
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.measure.throughput import Run, measure_generation

AR_NAME = "AR"
MLX_LM_NAME = "mlx-lm"


class BenchError(RedrafterError, ValueError):
    """A bad benchmark request (prompt set, grid, configs); the message says how to fix it."""


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One decoding configuration: our engine at ``shape`` (AR: plain decoding), or mlx-lm."""

    shape: BeamShape | None  # None: mlx-lm's own generator
    adapt: bool = False  # adaptive decoding starting from ``shape`` (engine/loop/adaptive.py)

    @property
    def kind(self) -> str:
        """``ar``, ``redrafter`` or ``mlx-lm``."""
        if self.shape is None:
            return "mlx-lm"
        return "ar" if self.shape.is_autoregressive else "redrafter"

    @property
    def name(self) -> str:
        """``AR``, ``W2×L4``, ``W2×L4 C6``, ``adaptive W4×L4`` or ``mlx-lm``."""
        if self.shape is None:
            return MLX_LM_NAME
        return f"adaptive {self.shape.label}" if self.adapt else self.shape.label

    def field(self, name: str) -> int | None:
        """``width``/``length``/``capacity``/``lookup``/``chain_length`` of a speculative
        shape (None otherwise)."""
        return getattr(self.shape, name) if self.kind == "redrafter" else None

    @property
    def drafts(self) -> bool:
        """Whether runs need the drafter (its shape, or adaptive decoding from it, has
        drafter beams); lookup-only shapes run without it."""
        return self.kind == "redrafter" and self.shape.drafts

    @property
    def has_lookup(self) -> bool:
        """Whether the shape verifies context-lookup chains."""
        return self.kind == "redrafter" and self.shape.lookup > 0

    @property
    def tree_size(self) -> int | None:
        """W·L + K·Lk, the unpacked tree size (None for plain decoding)."""
        if self.kind != "redrafter":
            return None
        s = self.shape
        return (s.width * s.length if s.drafts else 0) + s.lookup * s.chain_length + s.model_length


AR_CONFIG = Config(AR)
MLX_LM_CONFIG = Config(None)


def _int_list(text: str, what: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; BenchError naming ``what`` otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise BenchError(f"--grid {what} {text!r} must be comma-separated integers")
    return values


def parse_configs(text: str) -> list[BeamShape]:
    """``"AR,W1xL4,W1xL4+K1xL8 C12,K1xL8"`` -> the shapes (``BeamShape.parse`` labels),
    validated; BenchError naming ``--configs`` otherwise."""
    from redrafter_mlx.engine.core.shape import ShapeError

    labels = [label.strip() for label in text.split(",") if label.strip()]
    if not labels:
        raise BenchError(f"--configs {text!r} must be comma-separated shapes, e.g. AR,W1xL4,K1xL8")
    shapes = []
    for label in labels:
        try:
            shapes.append(BeamShape.parse(label).validate())
        except ShapeError as e:
            raise BenchError(f"--configs {label!r}: {e.message}") from None
    return shapes


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``"1,2x3,4"`` -> [(1, 3), (1, 4), (2, 3), (2, 4)]: widths x lengths."""
    widths, sep, lengths = text.lower().replace("×", "x").partition("x")
    if not sep:
        raise BenchError(f"--grid {text!r} must look like W1,W2,...xL1,L2,... (e.g. 1,2x4,5)")
    return [(w, n) for w in _int_list(widths, "widths") for n in _int_list(lengths, "lengths")]


# --------------------------------------------------------------------------- one run


def run_engine(
    engine, config: Config, ids: list[int], max_tokens: int, sampling, branches="auto"
) -> Run:
    """Generate with our engine (AR when ``config.kind == 'ar'``) and measure it; the
    drafter only for shapes with drafter beams (lookup alone runs without it), the draft
    model only for shapes with its chain (``D1×L``); ``branches``: ``--branches``."""
    draft = engine.draft_model if config.kind == "redrafter" and config.shape.model_length else None
    return measure_generation(
        engine.model,
        engine.drafter if config.drafts else None,
        engine.tokenizer,
        ids,
        config.shape,
        max_tokens,
        adapt=config.adapt,
        sampler=sampling,
        draft_model=draft,
        branches=branches,
    )


@dataclass
class MlxLm:
    """mlx-lm's model and tokenizer for the same base model (the ``--mlx-lm`` baseline)."""

    model: object
    tokenizer: object
    draft_model: object = None  # mlx-lm's speculative decoding (``speculative_generate_step``)
    num_draft_tokens: int = 0


def load_mlx_lm(
    model_path: str, dtype: str, draft_path: str | None = None, num_draft_tokens: int = 3
) -> MlxLm:
    """Load the base model with ``mlx_lm.load``, cast to the engine's dtype for fairness;
    ``draft_path``: the same draft model for mlx-lm's speculative decoding, drafting
    ``num_draft_tokens`` a step (the target itself when it names the model)."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_path)
    model.set_dtype(getattr(mx, dtype))
    draft = None
    if draft_path is not None:
        draft = model if draft_path == model_path else mlx_lm.load(draft_path)[0]
        draft.set_dtype(getattr(mx, dtype))
    return MlxLm(model, tokenizer, draft, num_draft_tokens if draft is not None else 0)


def run_mlx_lm(lm: MlxLm, ids: list[int], max_tokens: int, sampling) -> Run:
    """Generate with ``mlx_lm.generate.stream_generate`` on the same prompt ids and measure."""
    import importlib

    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    stream_generate = importlib.import_module("mlx_lm.generate").stream_generate
    sampler = make_sampler(
        sampling.temperature,
        top_p=sampling.top_p if sampling.top_p < 1 else 0.0,
        min_p=sampling.min_p,
        top_k=sampling.top_k,
    )
    context = sampling.repetition_context_size
    processors = make_logits_processors(
        dict(sampling.logit_bias) or None,
        sampling.repetition_penalty if sampling.repetition_penalty != 1.0 else None,
        context,
    )
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    mx.reset_peak_memory()
    tokens, first_at, last_at, drafted = [], None, None, 0
    start = time.perf_counter()
    for response in stream_generate(
        lm.model,
        lm.tokenizer,
        ids,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=processors,
        **(
            dict(draft_model=lm.draft_model, num_draft_tokens=lm.num_draft_tokens)
            if lm.draft_model is not None
            else {}
        ),
    ):
        last_at = time.perf_counter()
        first_at = first_at or last_at
        if response.finish_reason is None or response.finish_reason == "length":
            tokens.append(int(response.token))
            drafted += bool(getattr(response, "from_draft", False)) and len(tokens) > 1
    decoded = max(len(tokens) - 1, 0)
    steps = max(decoded - drafted, 0)  # each step: its accepted drafts and one token more
    return Run(
        tokens,
        decoded,
        last_at - first_at,
        steps,
        decoded / steps if steps else 1.0,
        1.0,
        first_at - start,
        mx.get_peak_memory() / 1e9,
        drafted,
        {"draft_model": drafted} if lm.draft_model is not None else {},
    )


# --------------------------------------------------------------------------- the benchmark


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt as benchmarked: its token ids, the prompt it comes from (its index in the
    set) and the turn (1, or 2: the conversation with the model's own first answer)."""

    ids: list[int]
    prompt: int
    turn: int = 1


@dataclass
class BenchResult:
    """All runs: ``runs[config name][i]`` is the run of ``items[i]``."""

    configs: list[Config]
    items: list[BenchPrompt]
    runs: dict[str, list[Run]] = field(default_factory=dict)
    greedy: bool = True

    @property
    def turns(self) -> list[int]:
        """The turns benchmarked, in order (``[1]`` or ``[1, 2]``)."""
        return sorted({item.turn for item in self.items})

    @property
    def num_prompts(self) -> int:
        """Prompts of the set benchmarked (each with one or two turns)."""
        return len({item.prompt for item in self.items})


Runner = Callable[[Config, list[int]], Run]


def run_bench(
    configs: list[Config],
    items: list[BenchPrompt],
    runner: Runner,
    greedy: bool,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Warm up each configuration once, then run all of them prompt by prompt (each turn of
    a prompt in order), interleaved."""
    result = BenchResult(configs, items, {c.name: [] for c in configs}, greedy)
    for config in configs:
        if progress:
            progress(f"warm-up {config.name}")
        runner(config, items[0].ids)
    total = result.num_prompts
    for item in items:
        if progress:
            turn = f", turn {item.turn}" if len(result.turns) > 1 else ""
            progress(f"prompt {item.prompt + 1}/{total}{turn}")
        for config in configs:
            result.runs[config.name].append(runner(config, item.ids))
    return result


def find_mismatches(result: BenchResult) -> list[dict]:
    """Greedy ReDrafter runs whose tokens differ from AR's: config, prompt, turn, first
    position."""
    if not result.greedy or AR_NAME not in result.runs:
        return []
    reference = result.runs[AR_NAME]
    found = []
    for config in result.configs:
        if config.kind != "redrafter":
            continue
        for item, run, ref in zip(result.items, result.runs[config.name], reference):
            if run.tokens != ref.tokens:
                position = next(
                    (k for k, (a, b) in enumerate(zip(run.tokens, ref.tokens)) if a != b),
                    min(len(run.tokens), len(ref.tokens)),
                )
                found.append(
                    dict(
                        config=config.name,
                        prompt=item.prompt,
                        turn=item.turn,
                        position=position,
                        tokens=len(run.tokens),
                        ar_tokens=len(ref.tokens),
                    )
                )
    return found


def mlx_lm_agreement(result: BenchResult) -> int | None:
    """Runs (prompt turns) where mlx-lm's greedy tokens equal AR's (None without mlx-lm)."""
    if not result.greedy or MLX_LM_NAME not in result.runs or AR_NAME not in result.runs:
        return None
    pairs = zip(result.runs[MLX_LM_NAME], result.runs[AR_NAME])
    return sum(a.tokens == b.tokens for a, b in pairs)


def _throughput(runs: list[Run]) -> float:
    """Total decode tokens / total decode time."""
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else 0.0


def source_share(runs: list[Run], name: str) -> float:
    """The share of accepted draft tokens that came from draft source ``name``
    (``engine.drafting.sources.SOURCE_NAMES``; 0 when none were accepted)."""
    accepted = sum(r.accepted_tokens for r in runs)
    return sum(r.source_tokens.get(name, 0) for r in runs) / accepted if accepted else 0.0


def source_shares(runs: list[Run]) -> dict:
    """Each draft source's share of the accepted draft tokens (``engine.drafting.sources``)."""
    names = dict.fromkeys(name for r in runs for name in r.source_tokens)
    return {name: round(source_share(runs, name), 4) for name in names}


def summarize(result: BenchResult) -> list[dict]:
    """One row per turn and configuration: tokens/s, paired speedup (against AR on the same
    turn's prompts), tokens/step, efficiency, lookup share, ..."""
    mismatched = {(m["config"], m["turn"]) for m in find_mismatches(result)}
    rows = []
    for turn in result.turns:
        picked = [i for i, item in enumerate(result.items) if item.turn == turn]
        ar_runs = [result.runs[AR_NAME][i] for i in picked] if AR_NAME in result.runs else []
        ar_tps = _throughput(ar_runs) if ar_runs else 0.0
        for config in result.configs:
            runs = [result.runs[config.name][i] for i in picked]
            rows.append(_summary_row(config, turn, runs, ar_tps, result.greedy, mismatched))
    return rows


def _summary_row(
    config: Config, turn: int, runs: list[Run], ar_tps: float, greedy: bool, mismatched: set
) -> dict:
    tps = _throughput(runs)
    steps = sum(r.steps for r in runs)
    tokens_per_step = sum(r.tokens_per_step * r.steps for r in runs) / steps if steps else 1.0
    packed = sum(r.mean_packed * r.steps for r in runs) / steps if steps else 0.0
    speedup = tps / ar_tps if ar_tps > 0 else 0.0
    return dict(
        config=config.name,
        turn=turn,
        kind=config.kind,
        width=config.field("width"),
        length=config.field("length"),
        capacity=config.field("capacity"),
        lookup_chains=config.field("lookup"),
        lookup_length=config.field("chain_length") if config.has_lookup else None,
        prompts=len(runs),
        tokens=sum(len(r.tokens) for r in runs),
        decode_s=sum(r.decode_s for r in runs),
        tokens_per_s=tps,
        speedup=speedup,
        tokens_per_step=tokens_per_step,
        efficiency=speedup / tokens_per_step,
        mean_packed=packed if config.kind == "redrafter" else None,
        tree_size=config.tree_size,
        lookup_share=source_share(runs, "lookup") if config.has_lookup else None,
        draft_model_length=config.field("model_length") or None,
        source_shares=source_shares(runs) if config.kind != "ar" else None,
        ttft_s=sum(r.ttft_s for r in runs) / len(runs),
        **branch_columns(runs),
        peak_memory_gb=max(r.peak_memory_gb for r in runs),
        # checked for greedy runs only: a sample differs from AR's by design
        matches_ar=((config.name, turn) not in mismatched)
        if config.kind == "redrafter" and greedy
        else None,
    )


# ``stats.branch_stats``' keys -> the summary's per-answer columns
BRANCH_COLUMNS = {
    "forks": "forks_per_answer",
    "steps": "steps_per_answer",
    "answer_tokens": "tokens_per_answer",
}


def branch_columns(runs: list[Run]) -> dict:
    """The means over ``runs`` of each answer's APAR numbers (``stats.branch_stats``: forks,
    sequential steps, tokens of the rebuilt text); None each when no run branched."""
    answers = [branch_stats(r.branches, r.steps, len(r.tokens)) for r in runs]
    answers = [a for a in answers if a is not None]
    if not answers:
        return dict.fromkeys(BRANCH_COLUMNS.values())
    n = len(answers)
    return {col: sum(a[key] for a in answers) / n for key, col in BRANCH_COLUMNS.items()}


def report(result: BenchResult, meta: dict) -> dict:
    """The ``--json`` object: metadata, one row per turn and configuration, mismatches."""
    mismatches = find_mismatches(result)
    return {
        **meta,
        "greedy": result.greedy,
        "num_prompts": result.num_prompts,
        "turns": result.turns,
        "num_runs": len(result.items),
        "configs": summarize(result),
        "per_prompt": {
            name: [
                dict(
                    prompt=item.prompt,
                    turn=item.turn,
                    tokens=len(r.tokens),
                    decode_s=r.decode_s,
                    ttft_s=r.ttft_s,
                    steps=r.steps,
                    branches=r.branches,
                    accepted_tokens=r.accepted_tokens,
                    source_tokens=r.source_tokens,
                )
                for item, r in zip(result.items, runs)
            ]
            for name, runs in result.runs.items()
        },
        "mismatches": mismatches,
        "mlx_lm_matching_prompts": mlx_lm_agreement(result),
        "ok": not mismatches,
    }


CSV_FIELDS = (
    "config",
    "turn",
    "kind",
    "width",
    "length",
    "capacity",
    "lookup_chains",
    "lookup_length",
    "prompts",
    "tokens",
    "decode_s",
    "tokens_per_s",
    "speedup",
    "tokens_per_step",
    "efficiency",
    "mean_packed",
    "tree_size",
    "lookup_share",
    "draft_model_length",
    "ttft_s",
    "peak_memory_gb",
    "forks_per_answer",
    "steps_per_answer",
    "tokens_per_answer",
    "matches_ar",
)


def write_csv(rows: list[dict], path: str) -> None:
    """One line per turn and configuration with the summary columns."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def render_table(rows: list[dict], title: str):
    """A rich table of the summary rows (mismatching configurations in red); fits 80 columns.
    With APAR branches the per-answer forks, sequential steps and tokens take the place of
    eff and packed (both still in ``--json`` and ``--csv``)."""
    from rich import box
    from rich.table import Table

    branching = any(row.get("forks_per_answer") is not None for row in rows)
    drafting = any(row.get("draft_model_length") for row in rows)  # a draft model's chain
    exiting = any((row.get("source_shares") or {}).get("early_exit") for row in rows)
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=0,
        caption="speedup: decode tok/s over the same prompts ÷ AR's · "
        + ("" if branching else "eff: speedup ÷ tok/step · packed: mean packed tree / W·L+K·Lk · ")
        + "lookup: share of accepted drafts from context lookup (draft: from the draft model"
        + ("; exit: from the early-exit adapter" if exiting else "")
        + ") · "
        "TTFT in ms · GB: peak memory" + (BRANCH_CAPTION if branching else ""),
    )
    cells = [_table_cells(row) for row in rows]
    columns = [c for c in cells[0] if c not in (BRANCH_HIDES if branching else BRANCH_CELLS)]
    columns = [c for c in columns if (c != "draft" or drafting) and (c != "exit" or exiting)]
    for column in columns:
        # a long config name wraps (at its space, else anywhere) before any number is cut
        table.add_column(
            column,
            justify="left" if column == "config" else "right",
            no_wrap=column != "config",
            overflow="fold",
        )
    for row, cell in zip(rows, cells):
        style = "red" if row["matches_ar"] is False and not row.get("near_tie") else None
        table.add_row(*(cell[c] for c in columns), style=style)
    return table


BRANCH_CELLS = ("forks", "steps", "tok/ans")  # columns shown when branches ran
BRANCH_HIDES = ("eff", "packed")  # the columns they replace (80 columns)
BRANCH_CAPTION = " · APAR branches, per answer: forks, sequential steps, tokens (rebuilt text)"


def _table_cells(row: dict) -> dict:
    """Every column's text for one summary row, in the table's order."""
    packed = row["mean_packed"]
    share = row.get("lookup_share")
    by_draft = (row.get("source_shares") or {}).get("draft_model")
    by_exit = (row.get("source_shares") or {}).get("early_exit")
    branch = [row.get(key) for key in BRANCH_COLUMNS.values()]
    return {
        "config": row["config"],
        "tok/s": f"{row['tokens_per_s']:.1f}",
        "speedup": f"{row['speedup']:.2f}×",
        "tok/step": f"{row['tokens_per_step']:.2f}",
        "eff": f"{row['efficiency']:.2f}",
        "packed": "–" if packed is None else f"{packed:.1f}/{row['tree_size']}",
        "lookup": "–" if share is None else f"{share:.0%}",
        "draft": "–" if by_draft is None else f"{by_draft:.0%}",
        "exit": "–" if by_exit is None else f"{by_exit:.0%}",
        **{c: "–" if v is None else f"{v:.1f}" for c, v in zip(BRANCH_CELLS, branch)},
        "TTFT": f"{row['ttft_s'] * 1e3:.0f}",
        "GB": f"{row['peak_memory_gb']:.3f}",
        "= AR": "[yellow]tie[/]"
        if row.get("near_tie")
        else {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "–"}[row["matches_ar"]],
    }
