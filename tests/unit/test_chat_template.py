"""Our chat-template renderer gives what transformers' apply_chat_template gives."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from swarmd.model import chat_template

# Shapes real templates use: ChatML with a default system turn, Llama 3 headers with a
# namespace and loop controls, Gemma's role check with raise_exception, tojson with
# non-ASCII text, a generation block.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% set ns = namespace(found=false) %}"
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{% set ns.found = true %}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}"
        "{% if loop.index > 20 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}{{ ns.found }}"
    ),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
        "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
    ),
    "tojson-generation": (
        "{% for m in messages %}{{ m | tojson }}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endif %}\n{% endfor %}"
        "{{ dict(a=1) | tojson }}"
    ),
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "  Hi, ça va? 日本語  "}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": 'Quote "this" and <b>that</b>'},
    ],
]


def reference(source: str, messages: list[dict[str, Any]], prompt: bool) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=source, add_generation_prompt=prompt, **SPECIAL
    )
    return str(rendered[0])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("prompt", [True, False])
def test_renders_as_transformers_does(name: str, index: int, prompt: bool) -> None:
    source, messages = TEMPLATES[name], CONVERSATIONS[index]
    try:
        expected = reference(source, messages, prompt)
    except jinja2.TemplateError as exc:
        with pytest.raises(jinja2.TemplateError, match=str(exc)[:30]):
            chat_template.render(source, messages, prompt, SPECIAL)
        return
    assert chat_template.render(source, messages, prompt, SPECIAL) == expected


def test_a_template_cannot_reach_underscore_attributes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{% set ns = namespace(_x=1) %}{{ ns }}", [], False, {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{{ messages.__class__.__mro__ }}", [], False, {})
