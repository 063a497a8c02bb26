"""The sampling flags of generate, chat and bench: declared once (``SamplingFlags``), so the
three commands show the same options with the same help and defaults, no command takes a
sampling setting of its own, and the settings a model's ``generation_config.json`` may fill
are the engine's one list."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest

from redrafter_mlx.cli import get_command
from redrafter_mlx.cli.common import FlagError, describe_sampling, flag_for, sampling_fields
from redrafter_mlx.cli.options import SamplingFlags, sampling_options
from redrafter_mlx.engine.core.sampling import GENERATION_CONFIG, MODEL_DEFAULT_KEYS, SamplerConfig
from tests.support.cli import invoke, model_args

COMMANDS = ("generate", "chat", "bench")
NAMES = [f.name for f in fields(SamplingFlags)]


def seen(param) -> tuple:
    """What a user sees of a typer option: its flags, help, default and whether shown."""
    kind = param.type_descriptor.annotation
    return (param.opts, param.secondary_opts, param.help, param.default, param.show_default, kind)


@pytest.fixture(scope="module")
def commands():
    root = get_command()
    return {name: root.commands[name] for name in COMMANDS}


def test_the_commands_show_the_declared_flags_alike_in_one_run(commands):
    declared = typing.get_type_hints(SamplingFlags, include_extras=True)
    shown = {}
    for name, command in commands.items():
        names = [p.name for p in command.params]
        start = names.index(NAMES[0])
        assert names[start : start + len(NAMES)] == NAMES, name  # in order, side by side
        shown[name] = [seen(p) for p in command.params[start : start + len(NAMES)]]
    assert shown["chat"] == shown["generate"] and shown["bench"] == shown["generate"]
    for field, (opts, _, help_text, default, _, _) in zip(fields(SamplingFlags), shown["chat"]):
        info = declared[field.name].__metadata__[0]
        assert opts == [info.default] and help_text == info.help  # the declaration's own
        assert default == field.default


def test_no_command_takes_a_sampling_setting_of_its_own(commands):
    own = {flag_for(f.name) for f in fields(SamplerConfig)}  # --temp, --top-p, --end-ids...
    ours = {flag_for(name) for name in NAMES}
    for name, command in commands.items():
        flags = {opt for p in command.params for opt in p.opts}
        assert flags & own <= ours, f"{name}: {sorted(flags & own - ours)}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses_the_flags_it_declares(app, pair, command):
    prompt = ["-p", "Hi"] if command == "generate" else []
    result = invoke(
        app, command, *model_args(pair), *prompt, "-n", 2, "--logit-bias", "5:oops", input="hi\n"
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("error: --logit-bias '5:oops' is not understood")


def test_the_flags_become_sampler_fields():
    typed = sampling_fields(SamplingFlags(temp=0.5, seed=3, logit_bias="7:-1"))
    assert SamplerConfig.resolve(typed) == SamplerConfig(temperature=0.5, logit_bias=((7, -1.0),))
    assert typed["seed"] == 3 and typed["top_p"] is None  # None: not given
    with pytest.raises(FlagError, match="--logit-bias"):
        sampling_fields(SamplingFlags(logit_bias="x"))


def test_the_model_fills_what_the_engine_lists():
    sampler = SamplerConfig(temperature=0.5)
    every = set(MODEL_DEFAULT_KEYS)
    assert describe_sampling(sampler, every, GENERATION_CONFIG).endswith("(flags)")
    for key in MODEL_DEFAULT_KEYS:  # one left to the model: the model's file is named
        note = describe_sampling(sampler, every - {key}, GENERATION_CONFIG)
        assert note.endswith(f"(model's {GENERATION_CONFIG}, flags)"), key


def test_a_command_gets_the_flags_as_one_value():
    @sampling_options
    def command(first: int = 1, sampling_flags: SamplingFlags = SamplingFlags(), last: int = 2):
        return first, sampling_flags, last

    params = list(typing.get_type_hints(command, include_extras=True))
    assert params[0] == "first" and params[1 : 1 + len(NAMES)] == NAMES
    assert command(first=3, temp=0.5, last=4) == (3, SamplingFlags(temp=0.5), 4)


def test_a_command_without_the_group_or_with_a_flag_of_its_own_is_refused():
    with pytest.raises(TypeError, match="one parameter typed SamplingFlags"):

        @sampling_options
        def bare(first: int = 1):
            return first

    with pytest.raises(TypeError, match="temp clash"):

        @sampling_options
        def twice(temp: float = 0.0, sampling_flags: SamplingFlags = SamplingFlags()):
            return temp
