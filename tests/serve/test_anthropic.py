"""The Anthropic Messages API (``POST /v1/messages``), raw HTTP per Anthropic's documented
schema, against the app over a scheduler that answers with known model text
(``tests.support.fakes.ScriptedScheduler``): a plain answer, system prompts, stop sequences, a
streamed tool call (its ``tool_use`` block and ``input_json_delta``, ``stop_reason``
``tool_use``), a ``tool_result`` sent back, ``tool_choice``, and Anthropic's error body.

The prompt of every request is checked against the one the OpenAI chat endpoint makes of
the same conversation (the same app, the same template), and each call against mlx-lm's
parser's reading of the same text.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from redrafter_mlx.serve.anthropic import parse_request
from redrafter_mlx.serve.app import ServeConfig, create_app
from tests.support.fakes import ScriptedScheduler
from tests.support.serving import ANSWERS, THINK, TIME, WEATHER, mlx_lm_calls

LIMIT = 256
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def anthropic_tool(spec: dict) -> dict:
    """An OpenAI function spec as an Anthropic custom tool."""
    f = spec["function"]
    tool = {"name": f["name"], "input_schema": f["parameters"]}
    return tool | ({"description": f["description"]} if "description" in f else {})


TOOL, TIME_TOOL = anthropic_tool(WEATHER), anthropic_tool(TIME)


def app_of(tok, answer: str, **kw) -> tuple[TestClient, ScriptedScheduler]:
    """Raw HTTP against the app over a scheduler that answers ``answer``."""
    scheduler = ScriptedScheduler(tok.encode(answer, add_bos=False), **kw)
    config = ServeConfig(tok, "tiny", LIMIT, 4096, tok.vocab_size, {})
    return TestClient(create_app(scheduler, config, start_engine=False)), scheduler


def ask(http: TestClient, **body):
    return http.post("/v1/messages", json={"model": "tiny", "max_tokens": 64, **body})


def openai_prompt(http: TestClient, scheduler: ScriptedScheduler, **body) -> list[int]:
    """The prompt the OpenAI chat endpoint makes of ``body`` (an OpenAI chat request)."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return scheduler.requests[-1].prompt


def sse(text: str) -> list[tuple[str, dict]]:
    """The stream's events, each ``event: <name>`` then ``data: <json>`` of that type."""
    out = []
    for chunk in text.split("\n\n"):
        if not chunk:
            continue
        head, data = chunk.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), chunk
        out.append((head[len("event: ") :], json.loads(data[len("data: ") :])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def assemble(events: list[tuple[str, dict]]) -> dict:
    """The message a client builds from the events, checking their documented order:
    ``message_start``, then each block's start, deltas, stop (one block at a time), then
    ``message_delta`` and ``message_stop``; ``ping`` anywhere."""
    events = [(n, d) for n, d in events if n != "ping"]
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert events[-2][0] == "message_delta"
    message, open_, partial = events[0][1]["message"], None, ""
    assert message["content"] == [] and message["stop_reason"] is None
    for name, data in events[1:-2]:
        blocks = message["content"]
        if name == "content_block_start":
            assert open_ is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_ = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_
            delta, block = data["delta"], blocks[open_]
            kind = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if kind is None:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial += delta["partial_json"]
            else:
                assert block["type"] == kind
                block[kind] += delta[kind]
        else:
            assert name == "content_block_stop" and data["index"] == open_
            if blocks[open_]["type"] == "tool_use":
                blocks[open_]["input"], partial = json.loads(partial), ""
            open_ = None
    assert open_ is None
    end = events[-2][1]
    message.update(end["delta"])
    message["usage"]["output_tokens"] = end["usage"]["output_tokens"]
    return message


def test_a_plain_answer_is_anthropics_message_object(toks):
    tok = toks["chatml"]
    http, scheduler = app_of(tok, "Paris is sunny today.")
    r = ask(http, messages=ASK)
    assert r.status_code == 200
    body = r.json()
    assert body.pop("speculation")["enabled"] is False
    assert body["id"].startswith("msg_") and body["id"] == scheduler.requests[0].id
    prompt = scheduler.requests[0].prompt
    assert body == {
        "id": body["id"],
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [{"type": "text", "text": "Paris is sunny today."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": len(prompt),
            "output_tokens": len(tok.encode("Paris is sunny today.", add_bos=False)),
        },
    }
    assert prompt == tok.chat_prompt(ASK) == openai_prompt(http, scheduler, messages=ASK)
    assert scheduler.requests[0].max_tokens == 64  # max_tokens reached the engine
    http2, _ = app_of(tok, "Paris is sunny today.", finish="length")
    assert ask(http2, messages=ASK).json()["stop_reason"] == "max_tokens"


def test_system_prompts_and_text_blocks_reach_the_template(toks):
    tok = toks["chatml"]
    http, scheduler = app_of(tok, "Yes.")
    blocks = [
        {"type": "text", "text": "What is the weather "},
        {"type": "text", "text": "in Paris?"},
    ]
    system = [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": " Answer in English."},
    ]
    for sys_value in ("Be brief. Answer in English.", system):
        r = ask(http, system=sys_value, messages=[{"role": "user", "content": blocks}])
        assert r.status_code == 200, r.text
        got = scheduler.requests[-1].prompt
        want = tok.chat_prompt(ASK, "Be brief. Answer in English.")
        assert got == want
    openai = [{"role": "system", "content": "Be brief. Answer in English."}, *ASK]
    assert got == openai_prompt(http, scheduler, messages=openai)
    assert "Be brief. Answer in English." in tok.decode(got)
    # a conversation: user, assistant, user
    turns = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Rome?"}]
    assert ask(http, messages=turns).status_code == 200
    assert scheduler.requests[-1].prompt == tok.chat_prompt(turns)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stop_sequences_end_the_answer_and_say_which(toks, step):
    tok = toks["chatml"]
    text = "It is sunny. END of the weather DONE"
    http, scheduler = app_of(tok, text, step=step)
    r = ask(http, messages=ASK, stop_sequences=["DONE", "END"])
    body = r.json()
    assert body["content"] == [{"type": "text", "text": "It is sunny. "}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert scheduler.requests[-1].cancelled.is_set()  # its row freed at the stop
    # the same tokens counted as the OpenAI endpoint counts them for its 'stop'
    o = http.post("/v1/chat/completions", json={"messages": ASK, "stop": ["DONE", "END"]})
    assert body["usage"]["output_tokens"] == o.json()["usage"]["completion_tokens"]
    assert o.json()["choices"][0]["message"]["content"] == "It is sunny. "
    streamed = assemble(sse(ask(http, messages=ASK, stop_sequences=["END"], stream=True).text))
    assert streamed["content"] == body["content"]
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == ("stop_sequence", "END")
    none = ask(http, messages=ASK, stop_sequences=["never"]).json()
    assert (none["stop_reason"], none["stop_sequence"]) == ("end_turn", None)
    assert none["content"][0]["text"] == text


@pytest.mark.parametrize("kind", sorted(ANSWERS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_tool_call_is_a_tool_use_block_with_its_input_json(toks, kind, step):
    tok, text = toks[kind], ANSWERS[kind]
    http, scheduler = app_of(tok, text, step=step)
    r = ask(http, messages=ASK, tools=[TOOL, TIME_TOOL], stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    message = assemble(events)
    calls = [b for b in message["content"] if b["type"] == "tool_use"]
    assert [{"name": c["name"], "arguments": c["input"]} for c in calls] == mlx_lm_calls(tok, text)
    assert len({c["id"] for c in calls}) == len(calls)
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert all(s["input"] == {} for s in starts if s["type"] == "tool_use")
    texts = "".join(b.get("text", "") for b in message["content"])
    assert "<tool_call>" not in texts and "[TOOL_CALLS]" not in texts
    thinking = [b for b in message["content"] if b["type"] == "thinking"]
    if kind == "qwen3":  # thinking, then its text, then the calls, in the answer's order
        assert [b["type"] for b in message["content"]] == ["thinking", "text", *["tool_use"] * 2]
        assert thinking == [{"type": "thinking", "thinking": "\nLet me think.\n", "signature": ""}]
        assert message["content"][1]["text"] == "\n\nI will look.\n"
    else:
        assert not thinking
    # the whole message is the one the stream builds
    whole = ask(http, messages=ASK, tools=[TOOL, TIME_TOOL]).json()
    assert [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]] == [
        {k: v for k, v in b.items() if k != "id"} for b in message["content"]
    ]
    assert whole["stop_reason"] == "tool_use"
    assert whole["usage"] == message["usage"]
    # the tools reach the template as the OpenAI endpoint gives them
    openai = openai_prompt(http, scheduler, messages=ASK, tools=[WEATHER, TIME])
    assert scheduler.requests[0].prompt == openai


def test_a_tool_result_sent_back_is_the_templates_tool_turn(toks):
    tok = toks["qwen3"]
    http, scheduler = app_of(tok, "It is 20 C in Paris.")
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    history = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "I will look."}, call]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "20 C"}]},
            {"type": "text", "text": "And in Kelvin?"},
        ]},
    ]  # fmt: skip
    r = ask(http, messages=history, tools=[TOOL])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == [{"type": "text", "text": "It is 20 C in Paris."}]
    assert body["stop_reason"] == "end_turn"
    arguments = json.dumps({"city": "Paris"})
    openai = [
        *ASK,
        {"role": "assistant", "content": "I will look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "20 C"},
        {"role": "user", "content": "And in Kelvin?"},
    ]  # fmt: skip
    prompt = scheduler.requests[0].prompt
    assert prompt == openai_prompt(http, scheduler, messages=openai, tools=[WEATHER])
    turns = parse_request({"max_tokens": 8, "messages": history}, LIMIT, tok).messages
    assert turns[2] == {  # the call's name given too, for a template that shows it
        "role": "tool",
        "content": "20 C",
        "tool_call_id": "toolu_1",
        "name": "get_weather",
    }
    shown = tok.decode(prompt)
    assert '"arguments": {"city": "Paris"}' in shown
    assert "<tool_response>\n20 C\n</tool_response>" in shown and "And in Kelvin?" in shown
    # a thinking block sent back (as a client keeps it) is not shown to the template
    thought = {"type": "thinking", "thinking": "SECRET", "signature": ""}
    history[1] = {"role": "assistant", "content": [thought, *history[1]["content"]]}
    assert ask(http, messages=history, tools=[TOOL]).status_code == 200
    assert scheduler.requests[-1].prompt == prompt


def test_tool_choice_any_a_named_tool_none_and_one_call_only(toks):
    tok = toks["qwen3"]
    opened = '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        http, scheduler = app_of(tok, opened)  # the answer goes on from the opened call
        body = ask(http, messages=ASK, tools=[TIME_TOOL, TOOL], tool_choice=choice).json()
        prompt = scheduler.requests[0].prompt
        assert prompt[-len(tok.markers.tool_ids) :] == list(tok.markers.tool_ids)
        assert [(b["name"], b["input"]) for b in body["content"]] == [
            ("get_weather", {"city": "Oslo"})
        ]
        assert body["stop_reason"] == "tool_use"
        named = choice["type"] == "tool"
        assert ("get_time" in tok.decode(prompt)) is not named  # a named tool shown alone
    http, scheduler = app_of(tok, ANSWERS["qwen3"], step=4)
    one = {"type": "auto", "disable_parallel_tool_use": True}
    body = ask(http, messages=ASK, tools=[TOOL], tool_choice=one).json()
    assert [b["input"] for b in body["content"] if b["type"] == "tool_use"] == [{"city": "Paris"}]
    assert body["stop_reason"] == "tool_use" and scheduler.requests[0].cancelled.is_set()
    call = ANSWERS["qwen3"][len(THINK) :]
    http, scheduler = app_of(tok, call)
    body = ask(http, messages=ASK, tools=[TOOL], tool_choice={"type": "none"}).json()
    assert body["content"] == [{"type": "text", "text": call}]  # as written: no call parsed
    assert body["stop_reason"] == "end_turn"
    assert "get_weather" in tok.decode(scheduler.requests[0].prompt)


CALL = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}


@pytest.mark.parametrize(
    "body, says",
    [
        ({"max_tokens": None}, "'max_tokens' is required"),
        ({"max_tokens": LIMIT + 1}, "serve --max-tokens-limit"),
        ({"temperature": 1.5}, "'temperature' must be in [0, 1]"),
        ({"top_k": 1.5}, "'top_k' must be an integer"),
        ({"top_p": 0}, "top_p"),
        ({"stop_sequences": "END"}, "'stop_sequences' must be a list"),
        ({"stop": ["END"]}, "send that instead"),
        ({"seed": 1}, "a field of the OpenAI endpoints"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "'thinking' is not supported"),
        ({"beam_width": 2}, "start the server with --beam-width"),
        ({"temprature": 0.5}, "unknown field 'temprature'"),
        ({"metadata": {"user": "a"}}, "only 'user_id'"),
        ({"service_tier": "priority"}, "'service_tier' must be"),
        ({"system": [{"type": "image"}]}, "this server runs text models"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "top-level 'system'"),
        ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "unknown key 'name'"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0] is a 'image' block: this server runs text models"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "x": 1}]}]},
         "unknown key 'x': a text block takes"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text must be a string"),
        ({"messages": [{"role": "user", "content": [CALL]}]},
         "a tool_use block belongs to a turn of the assistant"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sunny."}]}, "(a prefill)"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
         "tool_use_id 't9' answers no tool_use block"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "one of Anthropic's own tools"),
        ({"tools": [{"name": "get weather", "input_schema": {}}]}, "tools[0].name must be"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema must be"),
        ({"tools": [TOOL, TOOL]}, "'get_weather' is given twice"),
        ({"tool_choice": {"type": "any"}}, "'tool_choice' is 'any' but the request sends no"),
        ({"tools": [TOOL], "tool_choice": "auto"}, "'tool_choice' must be {\"type\": \"auto\"}"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}},
         "names the function 'x', which is not in 'tools' (get_weather)"),
        ({"tools": [TOOL], "tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
         "drop 'disable_parallel_tool_use'"),
    ],
)  # fmt: skip
def test_a_bad_request_is_anthropics_error_body_naming_the_field(toks, body, says):
    http, scheduler = app_of(toks["qwen3"], "x")
    r = ask(http, **{"messages": ASK, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == "invalid_request_error"
    assert says in error["error"]["message"], error["error"]["message"]
    assert not scheduler.requests  # nothing reached the engine


def test_other_errors_take_anthropics_shape_too(toks):
    http, scheduler = app_of(toks["chatml"], "x")

    def error_of(r, status: int, kind: str) -> str:
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
        return r.json()["error"]["message"]

    assert "is not served here" in error_of(
        ask(http, model="gpt-4", messages=ASK), 404, "not_found_error"
    )
    r = http.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in error_of(r, 400, "invalid_request_error")
    error_of(http.get("/v1/messages"), 405, "invalid_request_error")
    says = error_of(ask(http, messages=ASK, tools=[TOOL]), 400, "invalid_request_error")
    assert "'tools': this model's chat template has no tool support" in says
    result = {"type": "tool_result", "tool_use_id": "t1"}
    history = [*ASK, {"role": "assistant", "content": [CALL]}]
    history.append({"role": "user", "content": [result]})
    says = error_of(ask(http, messages=history), 400, "invalid_request_error")
    assert says.startswith("'messages[1].content[0]': this model's chat template has no tool")
    assert "drop 'tools' and the tool_use / tool_result blocks" in says
    assert not scheduler.requests
    # the OpenAI endpoints keep OpenAI's body
    r = http.post("/v1/chat/completions", json={"messages": ASK, "temperature": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_an_engine_failure_is_an_api_error_before_and_during_the_stream(toks):
    tok = toks["chatml"]
    http, _ = app_of(tok, "", error="the engine failed")
    for stream in (False, True):
        r = ask(http, messages=ASK, stream=stream)
        assert r.status_code == 500
        assert r.json() == {
            "type": "error",
            "error": {"type": "api_error", "message": "the engine failed"},
        }
    http, _ = app_of(tok, "Paris is", step=1, error="the engine failed")
    events = sse(ask(http, messages=ASK, stream=True).text)
    assert events[0][0] == "message_start" and events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}},
    )
    assert "message_stop" not in [n for n, _ in events]


def test_a_messages_request_runs_through_the_engine_as_the_chat_one_does(toks):
    """A real (tiny random) model: the Messages API's greedy answer, streamed and not, is
    the chat endpoint's for the same conversation, its tokens counted alike."""
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.models import tiny_drafter, tiny_model

    tok = toks["chatml"]  # no markers: the answer is one text block
    model = tiny_model(vocab=tok.vocab_size, hidden=32, layers=2)
    scheduler = Scheduler(model, tiny_drafter(model), BeamShape(2, 3), (), 2, 4)
    config = ServeConfig(tok, "tiny", 64, model.max_context, model.vocab_size, {})
    body = dict(messages=ASK, max_tokens=8, temperature=0)
    with TestClient(create_app(scheduler, config)) as http:
        whole = ask(http, **body, system="Be brief.").json()
        streamed = assemble(sse(ask(http, **body, system="Be brief.", stream=True).text))
        messages = [{"role": "system", "content": "Be brief."}, *ASK]
        openai = http.post("/v1/chat/completions", json={**body, "messages": messages}).json()
    text = openai["choices"][0]["message"]["content"]
    assert whole["content"] == ([{"type": "text", "text": text}] if text.strip() else [])
    assert (
        whole["usage"]
        == streamed["usage"]
        == {
            "input_tokens": openai["usage"]["prompt_tokens"],
            "output_tokens": openai["usage"]["completion_tokens"],
        }
    )
    assert whole["usage"]["output_tokens"] == 8 and whole["stop_reason"] == "max_tokens"
    assert streamed["stop_reason"] == "max_tokens"
    assert whole["content"] == streamed["content"]
