"""Benchmark logic behind ``redrafter-mlx bench``: AR vs ReDrafter (vs mlx-lm) on prompt sets.

Every configuration gets one warm-up run, then the timed runs are interleaved per prompt
(prompt 1: AR, cfg1, cfg2, ...; prompt 2: ...) so machine noise hits all configurations
alike. Speedup is paired: each configuration's total decode tokens / total decode time over
the same prompts, divided by AR's. Greedy runs must reproduce AR's tokens exactly; any
difference is a mismatch (a bug), reported per prompt.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redrafter_mlx.engine.shape import AR, BeamShape
from redrafter_mlx.measure.throughput import Run, measure_generation

AR_NAME = "AR"
MLX_LM_NAME = "mlx-lm"


class BenchError(ValueError):
    """A bad benchmark request (prompt set, grid); the message says how to fix it."""


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One decoding configuration: our engine at ``shape`` (AR: plain decoding), or mlx-lm."""

    shape: BeamShape | None  # None: mlx-lm's own generator
    adapt: bool = False  # adaptive decoding starting from ``shape`` (engine/adaptive.py)

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
        """``width``/``length``/``capacity`` of a ReDrafter shape (None otherwise)."""
        return getattr(self.shape, name) if self.kind == "redrafter" else None

    @property
    def tree_size(self) -> int | None:
        """W·L, the unpacked tree size (None for plain decoding)."""
        return self.shape.width * self.shape.length if self.kind == "redrafter" else None


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


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``"1,2x3,4"`` -> [(1, 3), (1, 4), (2, 3), (2, 4)]: widths x lengths."""
    widths, sep, lengths = text.lower().replace("×", "x").partition("x")
    if not sep:
        raise BenchError(f"--grid {text!r} must look like W1,W2,...xL1,L2,... (e.g. 1,2x4,5)")
    return [(w, n) for w in _int_list(widths, "widths") for n in _int_list(lengths, "lengths")]


# --------------------------------------------------------------------------- one run


def run_engine(engine, config: Config, ids: list[int], max_tokens: int, sampling) -> Run:
    """Generate with our engine (AR when ``config.kind == 'ar'``) and measure it."""
    return measure_generation(
        engine.model,
        engine.drafter,
        engine.tokenizer,
        ids,
        config.shape,
        max_tokens,
        adapt=config.adapt,
        sampler=sampling.sampler,
        seed=sampling.seed,
    )


@dataclass
class MlxLm:
    """mlx-lm's model and tokenizer for the same base model (the ``--mlx-lm`` baseline)."""

    model: object
    tokenizer: object


def load_mlx_lm(model_path: str, dtype: str) -> MlxLm:
    """Load the base model with ``mlx_lm.load``, cast to the engine's dtype for fairness."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_path)
    model.set_dtype(getattr(mx, dtype))
    return MlxLm(model, tokenizer)


def run_mlx_lm(lm: MlxLm, ids: list[int], max_tokens: int, sampling) -> Run:
    """Generate with ``mlx_lm.generate.stream_generate`` on the same prompt ids and measure."""
    import importlib

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    stream_generate = importlib.import_module("mlx_lm.generate").stream_generate
    sampler = make_sampler(
        sampling.temperature,
        top_p=sampling.top_p if sampling.top_p < 1 else 0.0,
        min_p=sampling.min_p,
        top_k=sampling.top_k,
    )
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    mx.reset_peak_memory()
    tokens, first_at, last_at = [], None, None
    start = time.perf_counter()
    for response in stream_generate(
        lm.model, lm.tokenizer, ids, max_tokens=max_tokens, sampler=sampler
    ):
        last_at = time.perf_counter()
        first_at = first_at or last_at
        if response.finish_reason is None or response.finish_reason == "length":
            tokens.append(int(response.token))
    steps = max(len(tokens) - 1, 0)
    return Run(
        tokens,
        steps,
        last_at - first_at,
        steps,
        1.0,
        1.0,
        first_at - start,
        mx.get_peak_memory() / 1e9,
    )


# --------------------------------------------------------------------------- the benchmark


@dataclass
class BenchResult:
    """All runs: ``runs[config name][prompt index]``, plus what was benchmarked."""

    configs: list[Config]
    prompts: list[str]
    runs: dict[str, list[Run]] = field(default_factory=dict)
    greedy: bool = True


Runner = Callable[[Config, list[int]], Run]


def run_bench(
    configs: list[Config],
    prompt_ids: list[list[int]],
    runner: Runner,
    prompts: list[str],
    greedy: bool,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Warm up each configuration once, then run all of them prompt by prompt, interleaved."""
    result = BenchResult(configs, prompts, {c.name: [] for c in configs}, greedy)
    for config in configs:
        if progress:
            progress(f"warm-up {config.name}")
        runner(config, prompt_ids[0])
    for i, ids in enumerate(prompt_ids):
        if progress:
            progress(f"prompt {i + 1}/{len(prompt_ids)}")
        for config in configs:
            result.runs[config.name].append(runner(config, ids))
    return result


def find_mismatches(result: BenchResult) -> list[dict]:
    """Greedy ReDrafter runs whose tokens differ from AR's: config, prompt, first position."""
    if not result.greedy or AR_NAME not in result.runs:
        return []
    reference = result.runs[AR_NAME]
    found = []
    for config in result.configs:
        if config.kind != "redrafter":
            continue
        for i, (run, ref) in enumerate(zip(result.runs[config.name], reference)):
            if run.tokens != ref.tokens:
                position = next(
                    (k for k, (a, b) in enumerate(zip(run.tokens, ref.tokens)) if a != b),
                    min(len(run.tokens), len(ref.tokens)),
                )
                found.append(
                    dict(
                        config=config.name,
                        prompt=i,
                        position=position,
                        tokens=len(run.tokens),
                        ar_tokens=len(ref.tokens),
                    )
                )
    return found


def mlx_lm_agreement(result: BenchResult) -> int | None:
    """Prompts where mlx-lm's greedy tokens equal AR's (None without an mlx-lm run)."""
    if not result.greedy or MLX_LM_NAME not in result.runs or AR_NAME not in result.runs:
        return None
    pairs = zip(result.runs[MLX_LM_NAME], result.runs[AR_NAME])
    return sum(a.tokens == b.tokens for a, b in pairs)


def _throughput(runs: list[Run]) -> float:
    """Total decode tokens / total decode time."""
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else 0.0


def summarize(result: BenchResult) -> list[dict]:
    """One row per configuration: tokens/s, paired speedup, tokens/step, efficiency, ..."""
    ar_tps = _throughput(result.runs[AR_NAME]) if AR_NAME in result.runs else 0.0
    mismatched = {m["config"] for m in find_mismatches(result)}
    rows = []
    for config in result.configs:
        runs = result.runs[config.name]
        tps = _throughput(runs)
        steps = sum(r.steps for r in runs)
        tokens_per_step = sum(r.tokens_per_step * r.steps for r in runs) / steps if steps else 1.0
        packed = sum(r.mean_packed * r.steps for r in runs) / steps if steps else 0.0
        speedup = tps / ar_tps if ar_tps > 0 else 0.0
        rows.append(
            dict(
                config=config.name,
                kind=config.kind,
                width=config.field("width"),
                length=config.field("length"),
                capacity=config.field("capacity"),
                prompts=len(runs),
                tokens=sum(len(r.tokens) for r in runs),
                decode_s=sum(r.decode_s for r in runs),
                tokens_per_s=tps,
                speedup=speedup,
                tokens_per_step=tokens_per_step,
                efficiency=speedup / tokens_per_step,
                mean_packed=packed if config.kind == "redrafter" else None,
                tree_size=config.tree_size,
                ttft_s=sum(r.ttft_s for r in runs) / len(runs),
                peak_memory_gb=max(r.peak_memory_gb for r in runs),
                # checked for greedy runs only: a sample differs from AR's by design
                matches_ar=(config.name not in mismatched)
                if config.kind == "redrafter" and result.greedy
                else None,
            )
        )
    return rows


def report(result: BenchResult, meta: dict) -> dict:
    """The ``--json`` object: metadata, one row per configuration, mismatches."""
    mismatches = find_mismatches(result)
    return {
        **meta,
        "greedy": result.greedy,
        "num_prompts": len(result.prompts),
        "configs": summarize(result),
        "per_prompt": {
            name: [
                dict(tokens=len(r.tokens), decode_s=r.decode_s, ttft_s=r.ttft_s, steps=r.steps)
                for r in runs
            ]
            for name, runs in result.runs.items()
        },
        "mismatches": mismatches,
        "mlx_lm_matching_prompts": mlx_lm_agreement(result),
        "ok": not mismatches,
    }


CSV_FIELDS = (
    "config",
    "kind",
    "width",
    "length",
    "capacity",
    "prompts",
    "tokens",
    "decode_s",
    "tokens_per_s",
    "speedup",
    "tokens_per_step",
    "efficiency",
    "mean_packed",
    "tree_size",
    "ttft_s",
    "peak_memory_gb",
    "matches_ar",
)


def write_csv(rows: list[dict], path: str) -> None:
    """One line per configuration with the summary columns."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def render_table(rows: list[dict], title: str):
    """A rich table of the summary rows (mismatching configurations in red); fits 80 columns."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="speedup: decode tok/s over the same prompts ÷ AR's · eff: speedup ÷ "
        "tok/step · packed: mean packed tree / W·L",
    )
    for column in (
        "config",
        "tok/s",
        "speedup",
        "tok/step",
        "eff",
        "packed",
        "TTFT ms",
        "peak GB",
        "= AR",
    ):
        table.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for row in rows:
        packed = (
            f"{row['mean_packed']:.1f}/{row['tree_size']}"
            if row["mean_packed"] is not None
            else "–"
        )
        same = {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "–"}[row["matches_ar"]]
        table.add_row(
            row["config"],
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}×",
            f"{row['tokens_per_step']:.2f}",
            f"{row['efficiency']:.2f}",
            packed,
            f"{row['ttft_s'] * 1e3:.0f}",
            f"{row['peak_memory_gb']:.3f}",
            same,
            style="red" if row["matches_ar"] is False else None,
        )
    return table


# --------------------------------------------------------------------------- verify cost


def verify_cost_rows(hidden: int, layers: int) -> list[dict]:
    """The verify-cost benchmark (``redrafter_mlx.measure.verify_cost.verify_cost``)."""
    from redrafter_mlx.measure.verify_cost import verify_cost

    return verify_cost(hidden=hidden, layers=layers)


def render_verify_cost(rows: list[dict], hidden: int, layers: int):
    """A rich table: verify time per capacity vs one autoregressive step."""
    from rich.table import Table

    table = Table(
        title=f"verify cost vs one AR step (hidden {hidden}, {layers} layers)",
        caption="timed in interleaved rounds; paired: median of per-round verify/AR ratios",
    )
    for column in ("capacity", "AR step ms", "verify ms", "verify / AR", "paired"):
        table.add_column(column, justify="right")
    for row in rows:
        paired = row.get("paired_ratio")
        table.add_row(
            str(row["capacity"]),
            f"{row['ar_ms']:.2f}",
            f"{row['verify_ms']:.2f}",
            f"{row['ratio']:.2f}×",
            "–" if paired is None else f"{paired:.2f}×",
        )
    return table


# --------------------------------------------------------------------------- step profile


def profile_rows(engine, shapes, ids, repeats: int) -> dict:
    """The per-phase step profile (``redrafter_mlx.measure.profile.profile_steps``)."""
    from redrafter_mlx.measure.profile import profile_steps

    full = [(s.width, s.length, s.slots) for s in shapes]
    return profile_steps(engine.model, engine.drafter, full, ids, repeats=repeats)


def render_profile(data: dict, title: str):
    """Two rich tables: ms per phase, and graph ops (kernels = ops that compute) per phase."""
    from rich import box
    from rich.table import Table

    phases = ("draft", "pack", "verify", "accept", "commit")
    ms = Table(
        title=f"{title} · ms per step (medians, interleaved)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="step: one compiled step · Σ: phases compiled apart · over: step - verify · "
        "loop: generation loop wall ms/step · host: loop - step",
    )
    ops = Table(
        title=f"{title} · graph ops per step (kernels/all)", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for col in ("config", *phases, "Σ", "step", "over", "loop", "host"):
        ms.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for col in ("config", *phases, "step"):
        ops.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in data["rows"]:

        def cell(key, r=r):
            return f"{r[key]:.2f}" if key in r else "–"

        def op_cell(phase, r=r):
            k = f"{phase}_kernels"
            return f"{r[k]}/{r[f'{phase}_ops']}" if k in r else "–"

        ms.add_row(
            r["config"],
            *[cell(f"{p}_ms") for p in phases],
            cell("phases_ms"),
            cell("step_ms"),
            cell("overhead_ms"),
            cell("loop_ms"),
            cell("host_ms"),
        )
        ops.add_row(r["config"], *[op_cell(p) for p in phases], op_cell("step"))
    return ms, ops
