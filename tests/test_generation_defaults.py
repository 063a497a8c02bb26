"""The Python API's defaults run what ``chat`` runs (issue 44, item 3): the plan is resolved
by the engine (``engine.plan``), and the CLI only maps its flags onto it."""

import redrafter_mlx
from redrafter_mlx.cli.common import BeamFlags, resolve_paths, resolve_plan
from redrafter_mlx.engine.bundled import demo_paths
from redrafter_mlx.engine.plan import PlanArgs, default_plan
from redrafter_mlx.engine.plan import resolve_plan as engine_plan
from redrafter_mlx.engine.sampling import SamplerConfig
from redrafter_mlx.engine.shape import AR


def test_stream_generate_with_no_shape_runs_what_chat_runs():
    """Before: the API ran W4xL4 without lookup, chat the preset with a lookup chain."""
    model, drafter, tok = redrafter_mlx.load(*demo_paths())
    chat = resolve_plan(resolve_paths(None, None), None, BeamFlags())  # chat with no flags
    assert chat.shape.lookup and chat.shape.drafts  # the preset with a lookup chain
    assert default_plan(drafter) == chat
    prompt = tok.encode("def is_even(n):")
    text = "".join(r.text for r in redrafter_mlx.stream_generate(model, drafter, tok, prompt))
    # adaptive over the candidates of chat's shape (the learnt settings are keyed by it)
    assert (id(drafter), chat.shape, SamplerConfig()) in model._adaptive
    plain = redrafter_mlx.generate(model, None, tok, prompt, shape=AR, adapt=False)
    assert text == plain


def test_no_drafter_means_lookup_alone_as_in_chat():
    plan = default_plan(None)
    assert plan.shape.lookup and not plan.shape.drafts
    assert "context lookup alone" in plan.source


def test_asked_arguments_win_and_bad_ones_name_their_field():
    import pytest

    from redrafter_mlx.engine.errors import ParamError

    drafter = str(demo_paths()[1])
    plan = engine_plan(None, drafter, args=PlanArgs(width=2, length=3, no_lookup=True))
    assert (plan.shape.width, plan.shape.length, plan.shape.lookup) == (2, 3, 0)
    for args, param in [
        (PlanArgs(lookup=-1), "lookup"),
        (PlanArgs(lookup_length=1), "lookup_length"),
        (PlanArgs(length=1), "length"),
    ]:
        with pytest.raises(ParamError) as e:
            engine_plan(None, drafter, args=args)
        assert e.value.param == param
