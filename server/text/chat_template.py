"""Chat template rendering (jinja2 sandbox, transformers-compatible) and the bundled DeepSeek-V3 template.

Rendering matches ``transformers``' ``apply_chat_template(..., tokenize=False)``: the same
sandboxed environment (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``), the same
``tojson`` (``ensure_ascii=False``, no HTML escaping), ``raise_exception``, ``strftime_now``,
a guarded ``namespace``/``dict``, and the same variables: ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the named special tokens (``bos_token``,
``eos_token``, ...) and any extra template kwargs (``thinking``, ``enable_thinking``, ...).

The bundled template ``templates/deepseek_v3.jinja`` (``DEEPSEEK_V3_CHAT_TEMPLATE``)
------------------------------------------------------------------------------------
A demo model is trained on text rendered by it, so this format is a contract. In the
layout below ``+`` is plain concatenation (no separators are added anywhere else):

* Start: ``bos_token`` + SYSTEM, where SYSTEM is the system (or developer) messages joined
  by ``"\\n\\n"``; when ``tools`` is given, a tools section is appended (after ``"\\n\\n"`` if
  SYSTEM is non-empty)::

      ## Tools\\n\\nYou can call these functions, each given as a JSON schema:\\n<tools>\\n
      {tool as JSON}\\n            (one line per tool, json.dumps(tool, ensure_ascii=False))
      </tools>\\n\\nTo call functions, answer with ... (fixed instructions showing the call format)

* User turn: ``<｜User｜>`` + content.
* Assistant turn: ``<｜Assistant｜>`` + content after the last ``</think>`` (earlier
  reasoning and ``reasoning_content`` are dropped, as DeepSeek does) + optional tool calls
  + ``<｜end▁of▁sentence｜>``. Tool calls::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
      \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>     (further calls)
      <｜tool▁calls▁end｜>

  ARGS is the ``arguments`` string verbatim, or ``json.dumps(args, ensure_ascii=False)`` for a dict.
* Tool results: a run of tool messages becomes
  ``<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>R1<｜tool▁output▁end｜>\\n<｜tool▁output▁begin｜>R2<｜tool▁output▁end｜>``
  and is closed by ``<｜tool▁outputs▁end｜>`` before whatever follows. An assistant turn (or
  the generation prompt) right after tool results has *no* ``<｜Assistant｜>`` marker: the
  answer follows ``<｜tool▁outputs▁end｜>`` directly (DeepSeek-V3's own convention).
* Generation prompt (``add_generation_prompt=True``): ``<｜Assistant｜>`` (or nothing after
  ``<｜tool▁outputs▁end｜>``), then ``<think>\\n`` when thinking is on. Thinking is on when
  template kwarg ``thinking`` is true (or DeepSeek's API form ``{"type": "enabled"}``), else
  when ``enable_thinking`` is true; default off.
  With thinking on the model is expected to write ``REASONING</think>ANSWER<｜end▁of▁sentence｜>``.
* Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
  without separator). An unknown role raises an error.

Example (system + tools, user, assistant tool call, tool result, generation prompt with
thinking on), ``\\n`` shown as real newlines::

    <｜begin▁of▁sentence｜>You are helpful.

    ## Tools

    You can call these functions, each given as a JSON schema:
    <tools>
    {"type": "function", "function": {"name": "get_weather", "parameters": {...}}}
    </tools>

    To call functions, answer with ...<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜><think>

"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_DIR = Path(__file__).parent / "templates"


def load_template(name: str) -> str:
    """Text of a bundled template, e.g. ``load_template("deepseek_v3")``."""
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


DEEPSEEK_V3_CHAT_TEMPLATE: str = load_template("deepseek_v3")


class ChatTemplateError(ValueError):
    """A template failed to compile or render (including ``raise_exception`` calls)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes; Hub templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the type object."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Namespace refusing underscore attributes (no route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja2's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by some Hub templates) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_env()


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (templates are reused for every request)."""
    try:
        return _ENV.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def content_to_text(content: Any) -> Any:
    """OpenAI content parts -> one string (text parts joined); strings and None pass through."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                out.append(str(part.get("text", "")))
        return "".join(out)
    return content


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_tool_call(call: Any) -> Any:
    # DeepSeek templates concatenate ``arguments`` as a string; clients sometimes send a dict.
    # json.dumps(ensure_ascii=False) is what the bundled template's tojson would print anyway.
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = {k: v for k, v in call["function"].items() if v is not None}
    if isinstance(fn.get("arguments"), Mapping):
        fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
    return {**{k: v for k, v in call.items() if v is not None}, "function": fn}


def normalize_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Make request messages look the way transformers hands them to templates.

    Keys whose value is None are dropped (templates test ``is defined``), content parts become
    one string, tool-call ``arguments`` given as a dict become JSON text, and ``reasoning`` / ``thinking`` / ``reasoning_content`` alias each other so any
    template finds the reasoning under the name it reads.
    """
    out = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"chat message must be an object, got {type(msg).__name__}")
        m = {k: v for k, v in msg.items() if v is not None}
        if "content" in m:
            m["content"] = content_to_text(m["content"])
        if isinstance(m.get("tool_calls"), (list, tuple)):
            m["tool_calls"] = [_normalize_tool_call(tc) for tc in m["tool_calls"]]
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    source: str,
    messages: list[Mapping[str, Any]],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``source`` the way transformers' ``apply_chat_template(tokenize=False)`` does.

    ``special_tokens`` supplies ``bos_token``/``eos_token``/...; explicit kwargs override them.
    """
    template = compile_template(source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(template_kwargs)
    variables.setdefault("documents", None)
    try:
        return template.render(
            messages=normalize_messages(messages),
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
