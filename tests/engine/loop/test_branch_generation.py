"""Parallel branches through the generation API: ``generate_steps`` streams each prompt's
rebuilt text (root -> detail -> next) as it becomes final, and ``branches="auto"|"on"|"off"``
picks the rules from the model's folder."""

import json

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN, BranchRules
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.generation import generate_steps, stream_generate
from redrafter_mlx.engine.loop.loading import load_model
from redrafter_mlx.engine.loop.run import resolve_branches
from tests.support.branching import (
    CHILD,
    EOS,
    FORK,
    PROMPT,
    RULES,
    forking_sampler,
    model_and_drafter,
    run_batch,
)

OTHER = [9, 8, 7, 6, 5]


def call(model, drafter, prompts, sampler, seed=0, shape=BeamShape(2, 3)):
    kw = dict(max_tokens=10, shape=shape, sampler=sampler, seed=seed, eos_token_ids=[EOS])
    return list(generate_steps(model, drafter, prompts, branches=RULES, **kw))


def test_events_stream_each_prompts_rebuilt_text_in_order():
    """Greedy, two prompts: each prompt's streamed tokens are its tree's rebuilt text; a
    request finishes once all its branches have; events name the branches that moved."""
    model, drafter = model_and_drafter()
    events = call(model, drafter, [PROMPT, OTHER], forking_sampler())
    trees = []
    for r, prompt in enumerate([PROMPT, OTHER]):
        roots, _, _ = run_batch(
            model,
            drafter,
            BeamShape(2, 3),
            [(prompt, forking_sampler(), 0, 10, True)],
            budget=True,
        )
        trees.append(roots[0].tree)
        streamed = [t for ev in events for t in ev.tokens[r]]
        assert streamed == trees[r].linear()
        assert FORK not in streamed and CHILD not in streamed
    assert [f is not None for f in events[-1].finish] == [True, True]
    assert all(None in ev.finish for ev in events[:-1])
    stats = events[-1].stats
    assert stats.branches == sum(len(t.branches) for t in trees) > 4
    assert stats.steps == len(events) - 1  # sequential steps; tokens count every branch's
    assert stats.generation_tokens > max(len(t.linear()) for t in trees)
    moved = {b for ev in events for row in ev.branches for b, _ in row}
    assert len(moved) > 2


def test_seeded_sampling_streams_the_same_text_as_the_loop():
    model, drafter = model_and_drafter()
    sampler = forking_sampler(temperature=0.8)
    events = call(model, drafter, [OTHER], sampler, seed=5)
    request = [(OTHER, sampler, 5, 10, True)]
    roots, _, _ = run_batch(model, drafter, BeamShape(2, 3), request, budget=True)
    assert [t for ev in events for t in ev.tokens[0]] == roots[0].tree.linear()
    assert len(roots[0].tree.branches) > 2


def test_branch_modes_resolve_from_the_tokenizer_folder(tmp_path):
    class NoFolder:
        pass

    assert resolve_branches(NoFolder(), "auto") is None
    assert resolve_branches(NoFolder(), RULES) is RULES
    with pytest.raises(ParamError, match="branches='on' needs the model's tokenizer folder"):
        resolve_branches(NoFolder(), "on")
    with pytest.raises(ParamError, match="must be one of"):
        resolve_branches(NoFolder(), "always")

    class Folder:
        path = tmp_path

    block = {"fork": FORK_TOKEN, "child": CHILD_TOKEN}
    (tmp_path / "config.json").write_text(json.dumps({"branches": block}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 10, CHILD_TOKEN: 11}))
    assert resolve_branches(Folder(), "auto") == BranchRules(10, 11)
    assert resolve_branches(Folder(), "off") is None


@pytest.fixture(scope="module")
def demo_apar(tmp_path_factory):
    """The demo model's folder with two of its ids named as the split tokens and a config
    marking it an APAR model (what ``convert`` writes for THUDM/apar-7b)."""
    base, _ = demo_paths()
    folder = tmp_path_factory.mktemp("apar-demo")
    for f in base.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((base / "config.json").read_text())
    config["branches"] = {"fork": FORK_TOKEN, "child": CHILD_TOKEN}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 4094, CHILD_TOKEN: 4095}))
    model, _ = load_model(folder)
    return model, load_tokenizer(folder)


def test_stream_generate_auto_turns_branches_on_for_an_apar_model(demo_apar):
    model, tok = demo_apar
    sampler = SamplerConfig(logit_bias=((4094, 40.0),))
    kw = dict(max_tokens=12, shape=BeamShape.autoregressive(), sampler=sampler, adapt=False)
    auto = list(stream_generate(model, None, tok, "def add(a, b):", **kw))
    rules = list(
        stream_generate(model, None, tok, "def add(a, b):", branches=BranchRules(4094, 4095), **kw)
    )
    off = list(stream_generate(model, None, tok, "def add(a, b):", branches="off", **kw))
    assert "".join(r.text for r in auto) == "".join(r.text for r in rules)
    assert auto[-1].branches > 1 and off[-1].branches == 0
    assert any(r.branch_tokens for r in auto) and not any(r.branch_tokens for r in off)
    assert 4095 not in [t for r in auto for t in r.tokens]
    # off: one sequence, in which neither split token is ever drawn (however likely)
    assert not {4094, 4095} & {t for r in off for t in r.tokens}


def test_branches_on_for_a_model_without_split_tokens_says_how_to_fix(demo_apar):
    model, _ = demo_apar
    base, _ = demo_paths()
    with pytest.raises(ParamError, match="--branches off"):
        list(stream_generate(model, None, load_tokenizer(base), "x", max_tokens=2, branches="on"))


def test_adaptive_branches_choose_per_batch_size_and_keep_the_text(monkeypatch):
    """With branches the rows come and go, so an adaptive run chooses as the server does,
    per batch size (``BatchChoice``); greedy text is the pinned run's."""
    from redrafter_mlx.engine.loop.adaptive import Adaptive
    from redrafter_mlx.engine.loop.batch_choice import BatchChoice

    ran = []
    finished = BatchChoice.finished

    def spy(self, rows, shape, counts, seconds):
        ran.append((rows, shape))
        return finished(self, rows, shape, counts, seconds)

    monkeypatch.setattr(BatchChoice, "finished", spy)

    model, drafter = model_and_drafter()
    kw = dict(max_tokens=10, shape=BeamShape(2, 3), sampler=forking_sampler(), seed=0)
    kw.update(eos_token_ids=[EOS], branches=RULES)
    pinned = list(generate_steps(model, drafter, [PROMPT, OTHER], **kw))
    every = Adaptive(every=1, probe=1)  # switch as often as it can
    adaptive = list(generate_steps(model, drafter, [PROMPT, OTHER], adapt=every, **kw))
    for r in range(2):
        want = [t for ev in pinned for t in ev.tokens[r]]
        assert [t for ev in adaptive for t in ev.tokens[r]] == want
    assert adaptive[-1].stats.branches == pinned[-1].stats.branches > 4
    assert len({shape for _, shape in ran}) > 1 and len({rows for rows, _ in ran}) > 1


@pytest.mark.parametrize("shape", ["AR", "W2xL3", "W1xL3+K1xL4"])
@pytest.mark.parametrize("sampler", [SamplerConfig(), SamplerConfig(temperature=1.0)],
                         ids=["greedy", "sampled"])  # fmt: skip
def test_branching_off_never_draws_a_split_token(shape, sampler):
    """A model with split tokens (``Model.split_ids``, set at load for an APAR folder)
    decoding one sequence: its rows draw exactly as if both split tokens were banned (a
    -1e6 logit bias on a model without them), even where the fork is the likeliest token,
    solo and batched, plain and speculative, greedy and seeded sampling."""
    from dataclasses import replace

    model, drafter = model_and_drafter()
    prompts = [PROMPT, OTHER]
    shape = BeamShape.parse(shape)
    kw = dict(max_tokens=16, shape=shape, seed=3, eos_token_ids=[EOS], adapt=False)
    likes_forks = replace(sampler, logit_bias=((FORK, 3.0), (CHILD, 2.0)))
    banned = replace(sampler, logit_bias=((FORK, -1e6), (CHILD, -1e6)))

    def tokens(sampler, rows):
        out = [[] for _ in rows]
        for ev in generate_steps(model, drafter, rows, sampler=sampler, **kw):
            for r, t in enumerate(ev.tokens):
                out[r] += t
        return out

    free = tokens(likes_forks, prompts)
    assert {FORK, CHILD} & {t for row in free for t in row}  # the control: drawn freely
    want, alone = tokens(banned, prompts), tokens(banned, prompts[1:])
    model.split_ids = (FORK, CHILD)
    try:
        assert tokens(likes_forks, prompts) == want
        assert tokens(likes_forks, prompts[1:]) == alone
    finally:
        model.split_ids = ()


def test_an_apar_folder_loads_with_its_split_ids(demo_apar):
    model, _ = demo_apar
    assert model.split_ids == (4094, 4095)
    assert load_model(demo_paths()[0])[0].split_ids == ()


def test_branching_answers_keep_their_shape_choice_across_calls():
    """With branches on, ``adapt=True`` chooses per batch size (``BatchChoice``) and keeps
    that choice on the model across calls (``learnt_batch``), as a solo answer keeps its
    ``Adaptive``: the next answer starts from what this one measured."""
    model, drafter = model_and_drafter()
    kw = dict(max_tokens=10, shape=BeamShape(2, 3), eos_token_ids=[EOS], branches=RULES)
    list(generate_steps(model, drafter, [PROMPT], sampler=forking_sampler(), adapt=True, **kw))
    (choice,) = model._batch_choice.values()
    first = sum(choice.ran.values())
    list(generate_steps(model, drafter, [PROMPT], sampler=forking_sampler(), adapt=True, **kw))
    assert list(model._batch_choice.values()) == [choice]
    assert first > 0 and sum(choice.ran.values()) > first
