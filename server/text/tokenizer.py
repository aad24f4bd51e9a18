"""Tokenizer loaded from a Hugging Face model folder, without transformers at run time.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(named special tokens, ``add_bos_token``/``add_eos_token``, ``chat_template`` as a string or a
list of named templates, ``added_tokens_decoder``) and ``generation_config.json`` (extra EOS
ids, default sampling values). Encoding, decoding and chat rendering give the same result as
transformers' fast tokenizer on the same files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from server.text.chat_template import render_chat_template

# Named special tokens transformers passes to chat templates (when set).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# generation_config.json keys that are sampling defaults for requests.
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "max_new_tokens", "do_sample")


class TokenizerError(ValueError):
    """The tokenizer folder is missing files or holds inconsistent ones."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells tokens as plain strings or as {"content": ..., "__type": "AddedToken"}.
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e


def _apply_added_token_flags(backend: _HFTokenizer, decoder: Mapping[str, Any]) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` wins over tokenizer.json (as in transformers).

    Only the "special" flag of tokens already in the vocabulary is reconciled; it decides what
    ``decode(skip_special_tokens=True)`` drops.
    """
    current = backend.get_added_tokens_decoder()
    for key, spec in decoder.items():
        if not isinstance(spec, Mapping) or "content" not in spec or "special" not in spec:
            continue
        tid = int(key)
        tok = current.get(tid)
        if tok is None or tok.content != spec["content"] or tok.special == bool(spec["special"]):
            continue
        backend.add_tokens([AddedToken(
            spec["content"], special=bool(spec["special"]), normalized=bool(spec.get("normalized", False)),
            lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
            single_word=bool(spec.get("single_word", False)),
        )])


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(self, backend: _HFTokenizer, config: Mapping[str, Any] | None = None,
                 generation_config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        generation_config = dict(generation_config or {})
        self._tok = backend
        _apply_added_token_flags(backend, config.get("added_tokens_decoder") or {})
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id: int | None = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id: int | None = (
            self.token_to_id(self.special_tokens["pad_token"]) if "pad_token" in self.special_tokens else None
        )

        # tokenizer.json's post-processor adds BOS/EOS when it has one (transformers 5 does the
        # same); without one, add_bos_token / add_eos_token from the config decide.
        self._manual_specials = backend.post_processor is None
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))

        self.chat_templates: dict[str, str] = {}
        tmpl = config.get("chat_template")
        if isinstance(tmpl, str):
            self.chat_templates["default"] = tmpl
        elif isinstance(tmpl, list):
            for item in tmpl:
                self.chat_templates[item["name"]] = item["template"]
        elif isinstance(tmpl, Mapping):
            self.chat_templates.update(tmpl)

        eos_ids: set[int] = set()
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        gen_eos = generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.update(int(i) for i in gen_eos)
        self.eos_token_ids: set[int] = eos_ids
        if self.bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_token_id = generation_config["bos_token_id"]
        self.generation_defaults: dict[str, Any] = {
            k: generation_config[k] for k in _GENERATION_KEYS if generation_config.get(k) is not None
        }
        self.model_max_length: int | None = config.get("model_max_length")

        # Ids dropped by decode(skip_special_tokens=True): tokenizer.json's special added tokens.
        self.special_ids: set[int] = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a model folder; ``tokenizer.json`` is required, the two configs optional."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj} not found (only fast tokenizers with tokenizer.json are supported)")
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise TokenizerError(f"cannot load {tj}: {e}") from e
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        return cls(backend, config, gen)

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (what the model's embedding must cover)."""
        return self._vocab_size

    @property
    def backend_tokenizer(self) -> _HFTokenizer:
        """The ``tokenizers.Tokenizer`` doing the work (transformers' name for it).

        ``decode`` is exactly its decode, so the incremental detokenizer can hand it to
        ``tokenizers.decoders.DecodeStream``.
        """
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their single ids.

        With ``add_special_tokens`` BOS/EOS are added as transformers would (chat prompts
        already contain BOS from the template, so the default is False).
        """
        if not self._manual_specials:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, name: str | None = None, tools: list | None = None) -> str:
        """Pick a template the way transformers does (named, ``tool_use`` when tools, ``default``)."""
        if not self.chat_templates:
            raise TokenizerError("tokenizer_config.json has no chat_template")
        if name is not None:
            if name in self.chat_templates:
                return self.chat_templates[name]
            return name  # a template text given directly
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise TokenizerError(f"no default chat template among {sorted(self.chat_templates)}")

    def apply_chat_template(self, messages: list[Mapping[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, *, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """Prompt text for ``messages``; ``template_kwargs`` are request ``chat_template_kwargs``."""
        return render_chat_template(
            self.get_chat_template(chat_template, tools),
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )
