"""The Python API's defaults run what ``chat`` runs: the plan is resolved
by the engine (``engine.loop.plan``), and the CLI only maps its flags onto it."""

import pytest

import redrafter_mlx
from redrafter_mlx.cli.common import BeamFlags, plan_from_flags, resolve_paths
from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR
from redrafter_mlx.engine.drafting.held import held_sources, sources_key
from redrafter_mlx.engine.loop.plan import PlanArgs, default_plan
from redrafter_mlx.engine.loop.plan import resolve_plan as engine_plan


def test_stream_generate_with_no_shape_runs_what_chat_runs():
    """Before: the API ran W4xL4 without lookup, chat the preset with a lookup chain."""
    model, drafter, tok = redrafter_mlx.load(*demo_paths())
    chat = plan_from_flags(resolve_paths(None, None), None, BeamFlags())  # chat with no flags
    assert chat.shape.lookup and chat.shape.drafts  # the preset with a lookup chain
    assert default_plan(drafter) == chat
    prompt = tok.encode("def is_even(n):")
    text = "".join(r.text for r in redrafter_mlx.stream_generate(model, drafter, tok, prompt))
    # adaptive over the candidates of chat's shape (the learnt settings are keyed by it)
    key = sources_key(held_sources(drafter))  # the run's sources: the drafter, the lookup
    assert (key, chat.shape, SamplerConfig()) in model._adaptive
    plain = redrafter_mlx.generate(model, None, tok, prompt, shape=AR, adapt=False)
    assert text == plain


def test_no_drafter_means_lookup_alone_as_in_chat():
    plan = default_plan(None)
    assert plan.shape.lookup and not plan.shape.drafts
    assert "context lookup alone" in plan.source


def test_asked_arguments_win_and_bad_ones_name_their_field():
    import pytest

    from redrafter_mlx.engine.base.errors import ParamError

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


@pytest.mark.parametrize("first", ["0", "1"])
def test_the_default_loop_reads_only_steps_already_followed_by_a_queued_one(monkeypatch, first):
    """In the default mode (adaptive, lookup chains, the per-step choice)
    step k+1 is queued before step k is read: one read per step, never of the newest step.
    Before: the per-step choice read step k, then queued step k+1 (the device waited).
    ``REDRAFTER_MLX_READ_FIRST=1`` (a per-backend choice, ``platform.read_first``) reads
    the newest step before choosing; both give the plain-decoding tokens."""
    from redrafter_mlx.engine.base.platform import READ_FIRST_ENV
    from redrafter_mlx.engine.loop import batch as batch_module
    from redrafter_mlx.engine.loop.batch_choice import SoloChoice
    from tests.support.models import tiny_drafter, tiny_model

    monkeypatch.setenv(READ_FIRST_ENV, first)
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    shape = default_plan(drafter).shape
    assert SoloChoice(
        model, held_sources(drafter), shape, SamplerConfig(), True
    ).each_step  # the default
    queued_then_read, real = [], batch_module.BatchGenerator.read

    def read(self, step):
        queued_then_read.append(self.stepping.inflight)  # steps queued and not yet read
        return real(self, step)

    monkeypatch.setattr(batch_module.BatchGenerator, "read", read)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    out = redrafter_mlx.batch_generate(model, drafter, None, [prompt], max_tokens=48)
    assert len(out[0]) == 48 and len(queued_then_read) > 10
    assert all(n == (1 if first == "1" else 2) for n in queued_then_read), queued_then_read
    plain = redrafter_mlx.batch_generate(model, None, None, [prompt], max_tokens=48, shape=AR)
    assert out == plain
