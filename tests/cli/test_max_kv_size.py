"""``--max-kv-size``: the KV cache holds at most N tokens per conversation. An answer stops
there (finish "context"), chat drops its oldest turns to fit, and what is generated inside
the bound is exactly what the model generates from that text."""

from redrafter_mlx.engine.core.shape import BeamShape
from tests.support.cli import invoke, model_args, run_json
from tests.support.models import run_decode, tiny_drafter, tiny_model


def test_a_capped_model_stops_at_the_cap_with_the_same_tokens():
    model = tiny_model(3, vocab=16, max_position_embeddings=4096)
    drafter = tiny_drafter(model, 4)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    full, _ = run_decode(model, drafter, prompt, max_tokens=60, shape=BeamShape(2, 4))
    model.cap_context(40)
    try:
        capped, _ = run_decode(model, drafter, prompt, max_tokens=60, shape=BeamShape(2, 4))
        events = []
        from redrafter_mlx.engine.loop.generation import generate_steps

        for ev in generate_steps(model, drafter, prompt, max_tokens=60, shape=BeamShape(2, 4)):
            events.append(ev)
    finally:
        model.cap_context(None)
    assert len(capped[0]) == 40 - 8  # the cache never holds more than the cap
    assert capped[0] == full[0][: len(capped[0])]
    assert events[-1].finish == ["context"]
    assert model.max_context == 4096


def test_generate_stops_at_max_kv_size(app, pair):
    args = ["generate", *model_args(pair), "-p", "Hello", "--raw", "-n", 200]
    data = run_json(app, *args, "--max-kv-size", 64)
    assert data["finish_reason"] == "context"
    assert data["stats"]["prompt_tokens"] + len(data["tokens"]) == 64


def test_chat_drops_turns_to_fit_max_kv_size(app, pair):
    script = "please explain " + "this " * 30 + "\n" + "and again " * 25 + "\n/quit\n"
    result = invoke(app, "chat", *model_args(pair), "-n", 8, "--max-kv-size", 128, input=script)
    assert result.exit_code == 0, result.output
    dropped = "dropped the oldest 1 turn(s) to fit the --max-kv-size cap of 128 tokens"
    assert dropped in result.stdout
    assert "error" not in result.stdout


def test_a_tiny_max_kv_size_is_a_flag_error(app, pair):
    result = invoke(app, "generate", *model_args(pair), "-p", "Hi", "--max-kv-size", 3)
    assert result.exit_code == 2 and "--max-kv-size must be >= 64" in result.output
