"""Chat rendering: our sandbox equals transformers' apply_chat_template, and the format is pinned."""
import copy
import json

import pytest

from server.text.chat_template import DEEPSEEK_V3_CHAT_TEMPLATE, ChatTemplateError, render_chat_template
from server.text.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city (température °C)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {"type": "object"}}},
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi there"}],
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "easy one"},
        {"role": "user", "content": [{"type": "text", "text": "And of "}, {"type": "text", "text": "Spain?"}]},
    ],
    "history_with_think": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "times 3?"},
    ],
    "tools_full_cycle": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": {"tz": "CET", "note": "été"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
    ],
    "tools_answered": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Rome."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_then_user": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "noon"},
        {"role": "user", "content": "ok"},
    ],
}

KWARGS = [{}, {"thinking": True}, {"thinking": False}, {"enable_thinking": True},
          {"thinking": False, "enable_thinking": True}, {"thinking": {"type": "disabled"}},
          {"thinking": {"type": "enabled"}}]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("kwargs", KWARGS, ids=lambda k: json.dumps(k))
def test_matches_transformers(tok, hf_tok, name, with_tools, add_generation_prompt, kwargs):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    ours = tok.apply_chat_template(copy.deepcopy(messages), tools=tools,
                                   add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = hf_tok.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=False,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == theirs
    # And the prompt tokenizes identically (markers become single ids).
    assert tok.encode(ours) == hf_tok.encode(ours, add_special_tokens=False)


def test_format_is_pinned(tok):
    """The exact layout a demo model is trained on (see chat_template module docstring)."""
    msgs = CONVERSATIONS["tools_full_cycle"]
    out = tok.apply_chat_template(msgs, tools=TOOLS[:1], add_generation_prompt=True, thinking=True)
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    expected = (
        "<｜begin▁of▁sentence｜>Use tools when useful.\n\n## Tools\n\n"
        "You can call these functions, each given as a JSON schema:\n<tools>\n" + tool_json + "\n</tools>\n\n"
        "To call functions, answer with one section holding one block per call, blocks separated by a newline:\n"
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n"
        "ARGUMENTS_AS_JSON\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        "<｜User｜>Weather and time in Paris?"
        "<｜Assistant｜><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\", \"note\": \"été\"}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{\"temp\": 21}<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜><think>\n"
    )
    assert out == expected


def test_simple_turns_and_thinking_switch(tok):
    msgs = CONVERSATIONS["history_with_think"]
    off = tok.apply_chat_template(msgs)
    assert off == "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>\n\n4<｜end▁of▁sentence｜><｜User｜>times 3?<｜Assistant｜>"
    assert tok.apply_chat_template(msgs, thinking=True) == off + "<think>\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True) == off + "<think>\n"
    assert tok.apply_chat_template(msgs, thinking=False, enable_thinking=True) == off
    assert tok.apply_chat_template(msgs, thinking={"type": "enabled"}) == off + "<think>\n"
    assert tok.apply_chat_template(msgs, thinking={"type": "disabled"}, enable_thinking=True) == off
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, thinking=True).endswith("times 3?")


def test_reasoning_content_is_dropped(tok):
    out = tok.apply_chat_template(CONVERSATIONS["system_user_assistant"])
    assert "easy one" not in out
    assert out.startswith("<｜begin▁of▁sentence｜>You are terse.\n\nAnswer in English.<｜User｜>")
    assert "<｜Assistant｜>Paris.<｜end▁of▁sentence｜><｜User｜>And of Spain?<｜Assistant｜>" in out


def test_unknown_role_raises(tok, hf_tok):
    msgs = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="Unsupported message role: wizard"):
        tok.apply_chat_template(msgs)
    with pytest.raises(Exception, match="Unsupported message role: wizard"):
        hf_tok.apply_chat_template(msgs, tokenize=False)


GLOBALS_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- if loop.index > 2 -%}{%- break -%}{%- endif -%}"
    "{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}{%- set ns.n = ns.n + 1 -%}"
    "[{{ m.content | tojson }}]{%- endfor -%}"
    "{{ ns.n }}|{{ tools | tojson(indent=2) }}|{{ custom_flag }}|{{ bos_token }}{{ eos_token }}"
    "|{{ strftime_now('%Y') | length }}|{{ dict(a=1) | tojson }}"
)


def test_globals_filters_and_loop_controls_match_transformers(tok, hf_tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<b>é</b>"},
            {"role": "user", "content": "never"}]
    ours = render_chat_template(GLOBALS_TEMPLATE, msgs, tools=TOOLS[:1], special_tokens=tok.special_tokens,
                                custom_flag="yes")
    theirs = hf_tok.apply_chat_template(msgs, tools=TOOLS[:1], tokenize=False, chat_template=GLOBALS_TEMPLATE,
                                        custom_flag="yes")
    assert ours == theirs
    assert '["<b>é</b>"]1|' in ours  # no HTML escaping, no ASCII escaping


def test_sandbox_blocks_escapes(tok):
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        render_chat_template(evil, [{"role": "user", "content": "x"}])
    with pytest.raises(Exception):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])


def test_named_templates_and_missing_template(tiny_dir, tmp_path):
    import shutil

    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": DEEPSEEK_V3_CHAT_TEMPLATE},
                            {"name": "tool_use", "template": "TOOLS{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    t = Tokenizer.from_dir(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(msgs, tools=TOOLS) == "TOOLS2"
    assert t.apply_chat_template(msgs).endswith("<｜User｜>hi<｜Assistant｜>")
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(msgs)


def test_dict_arguments_become_json_text_for_concatenating_templates(tok):
    """A template that does '...' + arguments (as DeepSeek's own does) works with dict arguments."""
    concat = "{% for m in messages %}{% for t in m.tool_calls %}{{ 'A=' + t.function.arguments }}{% endfor %}{% endfor %}"
    as_dict = [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": "é", "n": 1}}}]}]
    as_text = [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"x": "é", "n": 1}'}}]}]
    assert render_chat_template(concat, as_dict) == 'A={"x": "é", "n": 1}'
    assert tok.apply_chat_template(as_dict) == tok.apply_chat_template(as_text)
