"""Request rules shared by chat and completions: model name, MTP rules, lengths, sampling.

Every refusal is a 400 (404 for the model) that names the parameter and says what is
allowed.  MTP rules follow MindIE's endpoint (infer_param.cpp): ``n``/``best_of`` > 1 and
beam search cannot be used with the mtp plugin.  ``response_format`` and forced tool
calls are grammars (openai/grammars.py), enforced with MTP on.  Without MTP, ``n`` runs up to
``maxN`` (ScheduleConfig) choices, each its own engine request holding its own admission slot.
A ``prediction`` (OpenAI Predicted Outputs) is tokenized once here (``prediction_ids``); it
cannot be combined with several choices or with logprobs of the prompt.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Callable, TypeVar

P = TypeVar("P")
T = TypeVar("T")

from server.api.openai.protocol import SamplingFields, ignored_fields, parse_request
from server.api.settings import ApiSettings
from server.engine.protocol import SamplingParams
from server.web.errors import APIError, bad_request
from server.web.offload import off_loop

log = logging.getLogger("server.api")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(req: SamplingFields, settings: ApiSettings) -> None:
    if req.model is not None and req.model != settings.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", "model")


def check_request_rules(req: SamplingFields, settings: ApiSettings) -> None:
    """MTP rules, unsupported features and field combinations, before any tokenizing."""
    plugin = "mtp" if settings.mtp else None
    if req.prediction is not None:
        check_prediction_rules(req)
    if req.n > 1:
        if plugin:
            raise bad_request(f"n > 1 cannot be used with plugin {plugin} "
                              f"(speculative decoding); got n={req.n}, allowed: 1", "n")
        if req.n > settings.max_n:
            raise bad_request(f"n must be at most {settings.max_n} (ScheduleConfig.maxN); "
                              f"got n={req.n}", "n")
        if req.n > settings.max_link_num:
            raise bad_request(f"n={req.n} choices need {req.n} request slots, more than "
                              f"maxLinkNum ({settings.max_link_num}) allows", "n")
    if req.best_of is not None and req.best_of > 1:
        what = f"plugin {plugin}" if plugin else "this server"
        raise bad_request(f"best_of > 1 cannot be used with {what}; got best_of={req.best_of}, "
                          "allowed: 1", "best_of")
    if req.use_beam_search:
        what = f"plugin {plugin}" if plugin else "this server"
        raise bad_request(f"beam search cannot be used with {what}; "
                          "set use_beam_search to false", "use_beam_search")
    if req.response_format is not None and req.response_format.get("type") not in (None, "text") \
            and (req.ignore_eos or req.min_tokens):
        param = "ignore_eos" if req.ignore_eos else "min_tokens"
        raise bad_request(f"response_format cannot be combined with {param} (a finished "
                          "grammar allows only the end-of-sequence token)", param)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if req.min_tokens and req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens "
                          f"({req.max_tokens})", "min_tokens")


def check_prediction_rules(req: SamplingFields) -> None:
    """What a prediction cannot be combined with (``prediction: null`` is no prediction):
    several choices (as OpenAI refuses them) and logprobs of the prompt (completions'
    ``echo``, ``prompt_logprobs``)."""
    if req.n > 1 or (req.best_of is not None and req.best_of > 1):
        which = f"n={req.n}" if req.n > 1 else f"best_of={req.best_of}"
        raise bad_request(f"prediction cannot be used with more than one choice; got {which}, "
                          "allowed: 1", "prediction")
    if getattr(req, "echo", False):
        raise bad_request("prediction cannot be combined with echo (the prompt returned with "
                          "the answer, and with logprobs the logprobs of the prompt)",
                          "prediction")
    if req.prompt_logprobs is not None:
        raise bad_request("prediction cannot be combined with prompt_logprobs (logprobs of "
                          "the prompt)", "prediction")


def prediction_ids(req: SamplingFields, tokenizer: Any, settings: ApiSettings,
                   max_token_chars: int | None) -> tuple[int, ...] | None:
    """The prediction's token ids (``SamplingParams.prediction``), tokenized once with the
    model's tokenizer and no special tokens added; None without a prediction or for an
    empty one.  A prediction longer than ``maxSeqLen`` tokens is refused (before tokenizing
    when its characters alone prove it, as ``check_text_size`` does for prompts)."""
    text = req.prediction_text()
    if not text:
        return None
    limit = settings.max_seq_len
    if max_token_chars and len(text) > limit * max_token_chars:
        raise bad_request(f"the prediction ({len(text)} characters) has more tokens than "
                          f"this model's maximum context length ({limit} tokens, maxSeqLen)",
                          "prediction")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > limit:
        raise bad_request(f"the prediction has {len(ids)} tokens, more than this model's "
                          f"maximum context length ({limit} tokens, maxSeqLen)", "prediction")
    return tuple(ids) or None


def check_text_size(text: str, settings: ApiSettings, max_token_chars: int | None,
                    param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit the input limit whatever its
    tokens: no token covers more than ``max_token_chars`` characters, so a longer text has
    more than ``max_input_len`` tokens.  Tokenizing a 39 MB prompt takes minutes of CPU;
    this answers at once.  Only with truncation 0 (with truncation the text is cut)."""
    limit = settings.max_input_len
    if settings.truncation == 0 and max_token_chars and len(text) > limit * max_token_chars:
        raise bad_request(
            f"This model's input limit is {limit} tokens, and your prompt of {len(text)} "
            f"characters has more tokens than that (a token covers at most {max_token_chars} "
            "characters). Please reduce the length of the input (or enable truncation).",
            param)


def fit_prompt(ids: list[int], settings: ApiSettings, param: str) -> list[int]:
    """Apply the input limit: refuse (truncation 0) or cut right (-1) / left (1)."""
    limit = settings.max_input_len
    if not ids:
        raise bad_request("the prompt is empty", param)
    if len(ids) <= limit:
        return ids
    if settings.truncation == 0:
        raise bad_request(
            f"This model's maximum context length is {settings.max_seq_len} tokens and the "
            f"input limit is {limit} tokens. However, your request has {len(ids)} input "
            "tokens. Please reduce the length of the input messages (or enable truncation).",
            param)
    return ids[:limit] if settings.truncation < 0 else ids[-limit:]


def max_new_tokens(requested: int | None, prompt_len: int, settings: ApiSettings) -> int:
    """min(max_tokens, maxIterTimes, maxSeqLen - prompt) as MindIE does; None = the rest."""
    room = settings.max_seq_len - prompt_len
    if room <= 0:
        raise bad_request(f"the prompt ({prompt_len} tokens) leaves no room for output in "
                          f"maxSeqLen {settings.max_seq_len}", "max_tokens")
    value = room if requested is None else requested
    return max(0, min(value, settings.max_iter_times, room))


def _default(value: Any, defaults: dict, key: str, fallback: Any) -> Any:
    if value is not None:
        return value
    got = defaults.get(key)
    return fallback if got is None else got


def build_sampling(req: SamplingFields, *, max_tokens: int, defaults: dict, vocab_size: int,
                   logprobs: bool, top_logprobs: int, prompt_logprobs: int | None = None,
                   grammar: str | None = None,
                   prediction: tuple[int, ...] | None = None) -> SamplingParams:
    bias: dict[int, float] | None = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            tid = int(key)
            if not 0 <= tid < vocab_size:
                raise bad_request(f"logit_bias token id {tid} is outside the vocabulary "
                                  f"[0, {vocab_size})", "logit_bias")
            bias[tid] = float(value)
    for tid in req.stop_token_ids or ():
        if not 0 <= tid < vocab_size:
            raise bad_request(f"stop_token_ids holds {tid}, outside the vocabulary "
                              f"[0, {vocab_size})", "stop_token_ids")
    top_k = _default(req.top_k, defaults, "top_k", -1)
    # top_k at or above the vocabulary keeps every token: the same as no top-k, and a
    # value the engine's int64 tensors always hold.
    if top_k and top_k >= vocab_size:
        top_k = -1
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens),
        temperature=float(_default(req.temperature, defaults, "temperature", 1.0)),
        top_p=float(_default(req.top_p, defaults, "top_p", 1.0)),
        top_k=int(top_k) if top_k and top_k > 0 else -1,
        min_p=float(req.min_p or 0.0),
        repetition_penalty=float(_default(req.repetition_penalty, defaults,
                                          "repetition_penalty", 1.0)),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        logit_bias=bias,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        prediction=prediction,
    )


def warn_ignored(kind: str, fields: list[str]) -> None:
    """One bounded line: at most 16 names of at most 40 characters, never values (a 9.4 MB
    body once gave a 9.1 MB log line)."""
    if fields:
        shown = [f if len(f) <= 40 else f[:37] + "..." for f in fields[:16]]
        more = f" and {len(fields) - 16} more" if len(fields) > 16 else ""
        log.warning("The following fields were present in the %s request but ignored: %s%s",
                    kind, shown, more)


async def plan_request(kind: str, request_cls: type, plan_cls: Callable[[Any, Any], P],
                       state: Any, raw: Any, release: Callable[[], None],
                       inline: bool = False) -> P:
    """Parse, check and plan one request; a refusal frees its admission slots before raising,
    because no engine call will exist to free them later.  ``release`` is the request's
    ``limits.Ticket``: with ``n`` > 1 it grows to one slot per choice (503 when full).
    ``inline``: the body is small (``PLAN_INLINE_BYTES``, server/web/offload.py), plan it
    on the loop."""
    run = _on_loop if inline else off_loop
    try:
        # Validation and planning (template, tokenizing) of a large request run off the
        # event loop; slots are taken on it (``Admission`` is not thread-safe).
        req = await run(parse_request, request_cls, raw)
        warn_ignored(kind, ignored_fields(req))
        check_model(req, state.settings)
        check_request_rules(req, state.settings)
        if req.n > 1:                   # one slot per choice, taken before any tokenizing
            release.grow(req.n - 1)     # type: ignore[attr-defined]
        return await run(plan_cls, state, req)
    except BaseException:
        release()
        raise


async def _on_loop(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)
