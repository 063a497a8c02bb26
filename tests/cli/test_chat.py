"""`redrafter-mlx chat`: the command fed through stdin, and the ChatLoop driven directly
(KV-cache reuse across turns, /reset, /system, Ctrl-C mid-answer, context overflow)."""

from __future__ import annotations

import re

from redrafter_mlx.cli.chat_ui import run_chat
from tests.support.chat import MAX_TOKENS, interrupt_after, make_loop, output
from tests.support.cli import CONTEXT, invoke, model_args

# --------------------------------------------------------------------------- the command


def test_chat_command_over_stdin(app, pair):
    script = "hi\n/stats\nhello again\n/stats\n/reset\n/stats\n/quit\nnever read\n"
    result = invoke(app, "chat", *model_args(pair), "-n", MAX_TOKENS, input=script)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "redrafter-mlx chat" in out and "W1×L4" in out and "preset" in out
    prompts = [
        tuple(map(int, m)) for m in re.findall(r"prompt: (\d+) tokens, (\d+) prefilled", out)
    ]
    assert len(prompts) == 2
    (first_total, first_prefilled), (second_total, second_prefilled) = prompts
    assert first_prefilled == first_total  # nothing cached yet
    assert second_total > first_total
    assert second_prefilled < second_total - first_total + MAX_TOKENS  # the first turn was reused
    assert out.count(f"{MAX_TOKENS} tokens ·") == 2  # one dim stats line per answer
    assert re.search(r"steps emitting 1/2/3/4(/\d+)* tokens: ", out)
    assert "accepted drafts: " in out and " lookup" in out  # lookup is on by default
    assert "[conversation cleared]" in out
    assert "history: 0 messages, 0 tokens cached" in out and "no answer yet" in out


def test_chat_ends_at_end_of_input_and_rejects_bad_flags(app, pair):
    result = invoke(app, "chat", *model_args(pair), "-n", 2, input="hi\n")
    assert result.exit_code == 0, result.output
    result = invoke(app, "chat", *model_args(pair), "--beam-length", "1", input="hi\n")
    assert result.exit_code == 2 and "error: --beam-length" in result.stderr


def test_chat_no_draft(app, pair):
    result = invoke(app, "chat", *model_args(pair), "--no-draft", "-n", 3, input="hi\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "AR (--no-draft: plain decoding)" in result.stdout


# --------------------------------------------------------------------------- the loop


def test_turns_reuse_the_kv_cache_and_reset_clears_it(engine):
    loop = make_loop(engine)
    loop.answer("hi")
    first = loop.last
    assert first.prefilled_tokens == first.prompt_tokens
    loop.answer("hello again")
    second = loop.last
    assert second.prompt_tokens > first.prompt_tokens
    assert second.prefilled_tokens <= second.prompt_tokens - first.prompt_tokens + MAX_TOKENS
    assert [m["role"] for m in loop.messages] == ["user", "assistant"] * 2
    # The whole answer stays cached, but for its last token when no step ran after it (a
    # loop that reads each step before queueing the next does not write it; the next turn
    # prefills it).
    cached = len(loop.session.cached[0])
    assert second.prompt_tokens + second.generation_tokens - 1 <= cached
    assert cached <= second.prompt_tokens + second.generation_tokens

    loop.command("/reset")
    assert loop.messages == [] and loop.session.cached == [[]]
    loop.answer("hi")
    assert loop.last.prefilled_tokens == first.prompt_tokens


def test_ctrl_c_keeps_the_partial_answer_and_the_conversation(engine):
    loop = make_loop(engine, max_tokens=12)
    loop.stream = interrupt_after(2)
    partial = loop.answer("tell me a long story")
    assert partial and loop.messages[-1] == {"role": "assistant", "content": partial}
    assert "[interrupted]" in output(loop)
    cached = len(loop.session.cached[0])
    assert cached > len(loop.prompt_ids()) // 2  # the cache survived the interruption

    from redrafter_mlx.engine.loop.generation import stream_generate

    loop.stream = stream_generate
    loop.answer("go on")
    assert len(loop.messages) == 4 and loop.last.finish_reason == "length"
    assert loop.last.prefilled_tokens < loop.last.prompt_tokens  # still reusing the cache


def test_ctrl_c_before_any_text_forgets_the_message(engine):
    loop = make_loop(engine)
    loop.stream = interrupt_after(0, lose_cache=True)
    assert loop.answer("hi") == ""
    assert loop.messages == []
    from redrafter_mlx.engine.loop.generation import stream_generate

    loop.stream = stream_generate
    loop.answer("hi")  # a fresh session replaced the lost cache
    assert loop.last.prefilled_tokens == loop.last.prompt_tokens
    assert len(loop.messages) == 2


def test_context_overflow_drops_the_oldest_turns(engine):
    long = "please explain " + "this " * 110  # ~113 tokens: two turns exceed the 256 context
    loop = make_loop(engine)
    loop.answer(long + "first")
    loop.answer(long + "second")
    assert "dropped the oldest 1 turn(s)" in output(loop)
    assert loop.dropped_turns == 1
    assert [m["role"] for m in loop.messages] == ["user", "assistant"]
    assert loop.messages[0]["content"].endswith("second")
    assert loop.last.prompt_tokens + MAX_TOKENS <= CONTEXT


def test_a_message_too_long_for_the_context_is_an_error_not_a_crash(engine):
    loop = make_loop(engine)
    loop.answer("word " * (CONTEXT + 10))
    assert "error: prompt of" in output(loop) and loop.messages == []
    loop.answer("hi")
    assert len(loop.messages) == 2


def test_system_command(engine):
    loop = make_loop(engine)
    loop.command("/system")
    assert "(default) A chat between a curious user" in output(loop)
    loop.command("/system You are terse.")
    assert loop.system == "You are terse."
    assert engine.tokenizer.decode(loop.prompt_ids()).startswith("You are terse.")
    loop.command("/system")
    assert "system prompt: You are terse." in output(loop)


def test_commands_quit_help_and_unknown(engine):
    loop = make_loop(engine)
    assert loop.command("/quit") is False and loop.command("/exit") is False
    assert loop.command("/help") is True and "/reset" in output(loop)
    assert loop.command("/bogus") is True and "unknown command /bogus" in output(loop)


def test_show_accepted_colours_drafted_tokens(engine):
    from redrafter_mlx.engine.base.tokenizer import StreamDecoder
    from redrafter_mlx.engine.loop.generation import GenerationResponse

    ids = engine.tokenizer.encode("Hello world, how are you", add_bos=False)
    steps = [(ids[:1], [False]), (ids[1:4], [True, True, False]), (ids[4:], [False] * len(ids[4:]))]
    loop = make_loop(engine, show_accepted=True, terminal=True)
    decoder = StreamDecoder(engine.tokenizer)
    for i, (tokens, drafted) in enumerate(steps):
        response = GenerationResponse(
            text="",
            tokens=tokens,
            accepted=sum(drafted),
            drafted_tokens=drafted,
            finish_reason="length" if i == len(steps) - 1 else None,
            steps=i,
            prompt_tokens=1,
            prefilled_tokens=1,
            generation_tokens=0,
            prompt_tps=0,
            generation_tps=0,
            tokens_per_step=0,
            mean_packed=0,
            time_to_first_token=0,
            host_ms_per_step=0,
            peak_memory_gb=0,
        )
        loop.show(response, decoder)
    shown = output(loop)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert plain == engine.tokenizer.decode(ids)
    drafted_text = engine.tokenizer.decode(ids[:3])[len(engine.tokenizer.decode(ids[:1])) :]
    assert f"\x1b[32m{drafted_text}\x1b[0m" in shown


def test_run_chat_survives_ctrl_c_at_the_prompt(engine):
    loop = make_loop(engine, max_tokens=2)
    lines = iter(["hi", KeyboardInterrupt, "", "/quit", "unreached"])

    def read(prompt):
        line = next(lines)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line

    run_chat(loop, read)
    assert "Ctrl-D or /quit leaves" in output(loop)
    assert len(loop.messages) == 2
    assert next(lines) == "unreached"
