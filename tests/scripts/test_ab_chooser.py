"""scripts.experiments.ab_chooser: arms parse into chooser settings, and every arm's run is checked
against the recorded plain-decoding answer."""

import pytest

from redrafter_mlx.cli.common import load_engine, resolve_paths
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.generation import batch_generate
from scripts.experiments.ab_chooser import Arm, parse_arm, run


def test_arms_set_chooser_fields_and_reject_unknown_ones():
    assert parse_arm("A") == ("A", {})
    assert parse_arm("B:run_decay=0.8,max_probe=32") == ("B", {"run_decay": 0.8, "max_probe": 32})
    with pytest.raises(SystemExit, match="no field 'decay_rate'"):
        parse_arm("C:decay_rate=0.8")
    chooser = Arm(settings={"run_decay": 0.7}).new_chooser([AR, BeamShape(1, 2)], None)
    assert chooser.run_decay == 0.7


def test_each_arm_runs_every_prompt_turn_and_must_match_plain_decoding():
    engine = load_engine(resolve_paths("demo", None), "float32", with_drafter=True)
    prompts = [engine.tokenizer.encode("The cat sat on the mat. The cat"), [1, 5, 6, 7, 5, 6]]
    texts = []
    for ids in prompts:
        out = batch_generate(
            engine.model, None, engine.tokenizer, [ids], max_tokens=12, adapt=False
        )[0]
        texts.append(dict(set="edit", turn=1, prompt=list(ids), out=out))
    arms = {"A": Arm(), "B": Arm(settings={"run_decay": 0.8})}
    totals = run(engine, texts, arms, BeamShape.parse("W1xL4+K1xL8"), 12)
    for name in arms:
        tokens, steps, _, shapes = totals[("edit", 1, name)]
        assert tokens == sum(len(t["out"]) - 1 for t in texts)
        assert 0 < steps <= tokens and sum(shapes.values()) == steps
    texts[1]["out"] = texts[1]["out"][:-1] + [texts[1]["out"][-1] + 1]
    with pytest.raises(SystemExit, match="differs from plain decoding"):
        run(engine, texts, {"A": Arm()}, BeamShape.parse("W1xL4+K1xL8"), 12)
