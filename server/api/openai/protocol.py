"""Pydantic models of the request bodies clients send (OpenAI shape plus vLLM extras).

Unknown top-level fields are kept (``extra="allow"``) and reported by
``ignored_fields`` so the route can log them: SDKs forward provider extras through
``extra_body`` and refusing them would break clients.  Ranges are checked here; rules
that depend on the server (MTP, lengths, tools) live in ``server/api/serving/common.py``.

Types are strict (JSON types, no coercion): ``"max_tokens": "3"``, ``"stream": "true"``
and ``true`` where an integer is expected are refused, so a boolean never becomes a token
id.  Every integer has a bound, so no client value can overflow in the engine.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from server.web.errors import APIError

_TORCH_LONG = 2 ** 63 - 1
_INT32 = 2 ** 31 - 1
# A token id written as ASCII decimal (str.isdigit() also takes "²", which int() refuses).
_TOKEN_KEY = re.compile(r"-?[0-9]{1,10}", re.ASCII)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Base):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class FunctionDef(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Base):
    name: str = Field(min_length=1)


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Base):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Base):
    type: str
    text: str | None = None


class PredictionTextPart(BaseModel):
    """One part of a prediction's content list: OpenAI's text part, nothing else."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI Predicted Outputs: ``{"type": "content", "content": <string or text parts>}``.
    Exactly that shape (other keys, types or parts are refused, ``param: "prediction"``)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["content"]
    content: str | list[PredictionTextPart]

    def text(self) -> str:
        """The predicted text: the string, or the text parts concatenated in order."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


_PREDICTION_SHAPE = ('{"type": "content", "content": "<text>"} or {"type": "content", '
                     '"content": [{"type": "text", "text": "<text>"}, ...]}')


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class SamplingFields(_Base):
    """Fields shared by chat and completions."""
    model: str | None = None
    # PD disaggregation (vLLM's proxy protocol, server/pd): set by the coordinator
    kv_transfer_params: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=2 ** 31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32)   # >= vocab size: no top-k
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"pattern": "^-?[0-9]{1,10}$"}})
    seed: int | None = Field(default=None, ge=-_TORCH_LONG - 1, le=_TORCH_LONG)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=128)
    use_beam_search: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=_INT32)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)   # vLLM extra
    prediction: Prediction | None = None     # OpenAI Predicted Outputs (drafts to verify)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not _TOKEN_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids in ASCII decimal, "
                                 f"got {key[:24]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    @field_validator("prediction", mode="wrap")
    @classmethod
    def _prediction(cls, v: Any, handler: Any) -> Prediction | None:
        """Any flaw inside the object is reported on ``prediction`` itself (the OpenAI
        error's ``param``), naming where it is and the shapes accepted."""
        try:
            return handler(v)
        except ValidationError as exc:
            # The deepest error says most: for a list with a bad part it is the part's
            # ("content.0.type"), not the string branch's "should be a valid string".
            err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
            where = ".".join(str(p) for p in err.get("loc", ())
                             if str(p) not in _UNION_TAGS and "[" not in str(p)
                             and not str(p)[:1].isupper())
            msg = "not a JSON object" if err.get("type") == "model_type" else \
                err.get("msg", "invalid value")
            what = f"{where}: {msg}" if where else msg
            raise ValueError(f"prediction must be {_PREDICTION_SHAPE} ({what})") from None

    def prediction_text(self) -> str | None:
        """The prediction's text; None without one (an empty text is no prediction)."""
        return (self.prediction.text() or None) if self.prediction is not None else None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2 ** 31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None           # DeepSeek API: {"type": "enabled"}
    add_generation_prompt: bool = True
    include_reasoning: bool = True


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0, le=2 ** 31 - 1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


def ignored_fields(req: BaseModel) -> list[str]:
    """Top-level keys the client sent that no model field consumes."""
    return sorted((req.model_extra or {}).keys())


def parse_request(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate ``data`` into ``model``; any failure becomes a 400 naming the parameter."""
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        # Union members add their type name to the location ("str", "list[int]",
        # "NamedToolChoice"); keep only field path parts ("stream" is a field, not "str").
        loc = [p for p in loc if p not in _UNION_TAGS and "[" not in p and not p[:1].isupper()]
        param = ".".join(loc) or None
        raise APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}",
                       param) from None
