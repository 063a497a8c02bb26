"""``bench --profile`` and ``bench --verify-cost``, measured: one step per shape timed phase
by phase with its graph ops and priced where kernel launches dominate (``--launch-us``,
``--bandwidth-gbs``, ``--mac-dtype``), or one verify pass per capacity against one AR step
(``measure/``). ``bench_render.py`` draws them."""

from __future__ import annotations

from redrafter_mlx.cli.errors import FlagError

MAC_DTYPES = ("float16", "bfloat16", "float32")


def mac_cost(
    launch_us: float | None, bandwidth_gbs: float | None, mac_dtype: str | None, profile: bool
):
    """The launch-bound machine ``--profile`` prices each step on (``MacCost``), from
    ``--launch-us``, ``--bandwidth-gbs`` and ``--mac-dtype`` (None: the defaults)."""
    from redrafter_mlx.measure.profile import MacCost

    given = {"--launch-us": launch_us, "--bandwidth-gbs": bandwidth_gbs, "--mac-dtype": mac_dtype}
    named = [flag for flag, value in given.items() if value is not None]
    if named and not profile:
        raise FlagError(f"{named[0]} prices the --profile steps; add --profile or leave it out")
    if mac_dtype is not None and mac_dtype not in MAC_DTYPES:
        raise FlagError(f"--mac-dtype must be one of {', '.join(MAC_DTYPES)}, got {mac_dtype!r}")
    defaults = MacCost()
    try:
        return MacCost(
            defaults.launch_us if launch_us is None else launch_us,
            defaults.bandwidth_gbs if bandwidth_gbs is None else bandwidth_gbs,
            defaults.dtype if mac_dtype is None else mac_dtype,
        )
    except ValueError as e:
        raise FlagError(str(e)) from None


def verify_cost_rows(hidden: int, layers: int) -> list[dict]:
    """The verify-cost benchmark (``redrafter_mlx.measure.verify_cost.verify_cost``)."""
    from redrafter_mlx.measure.verify_cost import verify_cost

    return verify_cost(hidden=hidden, layers=layers)


def profile_rows(engine, shapes, ids, repeats: int, cost=None) -> dict:
    """The per-phase step profile (``redrafter_mlx.measure.profile.profile_steps``); shapes
    with lookup chains get their whole step and loop timed, their phases left out. Each row
    also gets the launch-bound estimate of its step at ``cost`` (a ``MacCost``; default: its
    defaults), and ``mac`` says what the estimate assumed."""
    from redrafter_mlx.engine.drafting.held import held_sources
    from redrafter_mlx.measure.profile import MacCost, launch_bound, profile_steps, weight_bytes

    cost = cost or MacCost()
    draft = getattr(engine, "draft_model", None)
    sources = held_sources(engine.drafter, draft)  # the boundary: resolved once
    data = profile_steps(engine.model, sources, list(shapes), ids, repeats=repeats)
    # The draft slot's forwards read its weights (the model's own, as its own draft; an
    # early-exit adapter's chain: the target's first layers, the adapter and the head).
    weights = weight_bytes(engine.model, sources, cost.dtype)
    data["rows"] = launch_bound(data["rows"], weights, cost)
    data["mac"] = dict(
        launch_us=cost.launch_us,
        bandwidth_gbs=cost.bandwidth_gbs,
        dtype=cost.dtype or engine.dtype,
        model_bytes=weights.model,
        drafter_bytes_per_draft_step=weights.drafter_step,
        drafter_bytes_once=weights.drafter_once,
    )
    return data
