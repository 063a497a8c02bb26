"""Small byte-level BPE tokenizers with chat templates that render tools, for the server's
tool-call and reasoning tests.

The templates are written here in the shape of the published ones (each holds the markers
mlx-lm reads to choose its tool parser, ``mlx_lm.tokenizer_utils._infer_tool_parser``):

- ``QWEN3``: ChatML, tools listed in the system turn, calls as ``<tool_call>`` JSON
  (mlx-lm's ``json_tools``), results in ``<tool_response>``, ``<think>`` blocks, and
  ``enable_thinking=False`` writing an empty thinking block as Qwen3's template does;
- ``QWEN3_CODER``: the same turns, calls as ``<tool_call>\\n<function=NAME>`` with
  ``<parameter=...>`` blocks (``qwen3_coder``);
- ``MISTRAL``: ``[INST]`` turns, ``[AVAILABLE_TOOLS]``, calls after the control token
  ``[TOOL_CALLS]`` (``mistral``), results in ``[TOOL_RESULTS]``;
- ``CHATML``: no tools at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from redrafter_mlx.engine.base.tokenizer import Tokenizer, load_tokenizer

_CALLS_AS_JSON = (
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function or tc %}"
    '\n<tool_call>\n{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n'
    "</tool_call>{%- endfor %}"
)
_CALLS_AS_XML = (
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function or tc %}"
    "\n<tool_call>\n<function={{ f.name }}>\n"
    "{%- for k, v in f.arguments.items() %}\n<parameter={{ k }}>\n{{ v }}\n</parameter>"
    "{%- endfor %}\n</function>\n</tool_call>{%- endfor %}"
)


def _chatml_with_tools(calls: str, how: str) -> str:
    return (
        "{%- if tools %}<|im_start|>system\n"
        "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
        "# Tools\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
        + how
        + "<|im_end|>\n"
        "{%- elif messages[0].role == 'system' %}"
        "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'tool' %}"
        "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
        "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
        + calls
        + "<|im_end|>\n"
        "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
    )


QWEN3 = _chatml_with_tools(
    _CALLS_AS_JSON,
    'Call a function as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; '
    "each call names a tool_call.name from the list.",
)
QWEN3_CODER = _chatml_with_tools(
    _CALLS_AS_XML,
    "Call a function as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
    "</function>\n</tool_call>",
)
MISTRAL = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.tool_calls %}{%- for tc in m.tool_calls %}"
    "[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}"
    "{%- endfor %}{{ eos_token }}"
    "{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = [
    "hello world, the user and the assistant talk about the weather in Paris today",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Let me think. The answer is 42. I will call a function get_weather city unit",
]
# (special tokens: control tokens, left out of decoded text; other added tokens: plain text)
_CHATML_TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [])
_QWEN3_TOKENS = (
    _CHATML_TOKENS[0],
    ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
)
_MISTRAL_TOKENS = (
    ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
    + ["[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
    + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
    [],
)
KINDS = {
    "qwen3": (QWEN3, _QWEN3_TOKENS, "<|im_end|>", None),
    "qwen3_coder": (QWEN3_CODER, _QWEN3_TOKENS, "<|im_end|>", None),
    "mistral": (MISTRAL, _MISTRAL_TOKENS, "</s>", "<s>"),
    "chatml": (CHATML, _CHATML_TOKENS, "<|im_end|>", None),
}


def chat_tokenizer(kind: str, folder: Path) -> Tokenizer:
    """The ``kind`` (a key of ``KINDS``) tokenizer, written to ``folder`` and loaded."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    template, (special, added), eos, bos = KINDS[kind]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=template,
        eos_token=eos,
        bos_token=bos,
        additional_special_tokens=[t for t in special if t not in (eos, bos)],
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)
