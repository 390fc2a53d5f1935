"""Chat templates in the shapes of the families moezero imports, written here (nothing is
downloaded), and a tiny tokenizer folder holding one (``tokenizer_util``'s BPE plus the families'
control tokens as special tokens).

- ``CHATML``: Qwen2-style ``<|im_start|>role ... <|im_end|>``, a default system message, tool
  calls through ``tojson`` and tool results folded into user turns.
- ``QWEN3``: ChatML with reasoning: ``<think>`` kept only after the last user query (a
  ``namespace`` loop), so earlier turns render differently once later ones follow;
  ``QWEN3_GENERATION`` is the same with ``{% generation %}`` markers.
- ``MISTRAL``: Mixtral/Mistral ``<s>[INST] ... [/INST] reply</s>``, alternation enforced with
  ``raise_exception``.
- ``OLMOE``: OLMoE/Tulu ``<|user|>``/``<|assistant|>`` blocks written without whitespace control
  (``trim_blocks``/``lstrip_blocks`` matter), a dated system line through ``strftime_now``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

CONTROL = ("<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "<|system|>", "<|user|>",
           "<|assistant|>", "<think>", "</think>", "<tool_call>", "</tool_call>")

CHATML = """\
{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_QWEN3 = """\
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        @@OPEN@@{{- message.content + '<|im_end|>' }}@@CLOSE@@
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN3 = _QWEN3.replace("@@OPEN@@", "").replace("@@CLOSE@@", "")
QWEN3_GENERATION = _QWEN3.replace("@@OPEN@@", "{% generation %}").replace(
    "@@CLOSE@@", "{% endgeneration %}")

MISTRAL = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

OLMOE = """{{ bos_token }}{{ '<|system|>\nToday is ' + strftime_now('%Y-%m-%d') }}
{% for message in messages %}
{% if message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] }}
{% elif message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] }}
{% elif message['role'] == 'assistant' %}
{% if not loop.last %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% else %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3_GENERATION, "mistral": MISTRAL, "olmoe": OLMOE}


def chat_tokenizer(folder: Path, template: str | None, *, legacy: bool = False) -> Path:
    """A tokenizer folder with the families' control tokens and ``template`` saved as
    ``chat_template.jinja`` (transformers 5), or inside ``tokenizer_config.json`` (``legacy``)."""
    tok = train_bpe(sentences(400) + ["Hello, how are you? I am fine. 2+2=4 ünïcødé ✓"])
    tok.add_special_tokens(list(CONTROL))
    save_tokenizer(tok, folder)
    if template is not None and legacy:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                  "chat_template": template}))
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder
