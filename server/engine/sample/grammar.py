"""Grammar-constrained decoding: llguidance matchers, compiled once per grammar (masks: sample/grammar_masks.py).

A constrained request carries its grammar as text (``SamplingParams.grammar``, llguidance's
serialised grammar, built in server/api/openai/grammars.py).  The worker keeps one compiled,
pristine matcher per distinct grammar (``GrammarBook``) and gives each request a copy;
the copy advances only by the tokens the request really emitted (``commit``), so a
preempted or resumed request rebuilds it from its output tokens.

Token masks (and how they keep MTP lossless): sample/grammar_masks.py.  No torch here: the
serving process validates grammars with a GrammarBook without loading it.
"""
from __future__ import annotations

import threading
from typing import Any

try:                                    # the `llguidance` package (a project dependency)
    import llguidance
except ImportError:                     # pragma: no cover - refused per request instead
    llguidance = None


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a matcher that left the grammar."""


class GrammarBook:
    """Compiled grammars of one worker (or API process), keyed by grammar text.

    ``compile`` may run on any thread (the API layer calls it before submitting, so the
    engine thread only copies); ``matcher`` copies the pristine matcher for a request.
    """

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, max_entries: int = 256) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._compiled: dict[str, Any] = {}
        self.num_compiled = 0                         # cache misses (for tests and logs)

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            if llguidance is None:
                raise GrammarError("grammar-constrained decoding needs the llguidance package")
            if self.tokenizer_dir is None:
                raise GrammarError("this engine has no tokenizer for grammar masks "
                                   "(EngineConfig.tokenizer_dir)")
            from server.text.tokenizer import Tokenizer
            tok = Tokenizer.from_dir(self.tokenizer_dir)
            eos = sorted(tok.eos_token_ids)
            self._lltok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(),
                                                 n_vocab=self.vocab_size,
                                                 eos_token=eos if eos else None)
        return self._lltok

    def compile(self, grammar: str) -> Any:
        """The pristine matcher for ``grammar`` (compiled on first sight, then cached)."""
        m = self._compiled.get(grammar)
        if m is not None:
            return m
        with self._lock:
            m = self._compiled.get(grammar)
            if m is None:
                m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0) \
                    if llguidance is not None else None
                if m is None:
                    raise GrammarError("grammar-constrained decoding needs the llguidance package")
                if m.is_error():
                    raise GrammarError(f"grammar does not compile: {m.get_error()}")
                if len(self._compiled) >= self.max_entries:
                    self._compiled.pop(next(iter(self._compiled)))      # oldest first
                self._compiled[grammar] = m
                self.num_compiled += 1
        return m

    def matcher(self, grammar: str, emitted: list[int]) -> Any:
        """A request's own matcher, advanced over the output tokens it already has."""
        m = self.compile(grammar).deep_copy()
        if emitted and m.try_consume_tokens(list(emitted)) != len(emitted):
            raise GrammarError("the request's output so far does not follow its grammar")
        return m


def commit(m: Any, tokens: list[int], stopped: bool) -> None:
    """Advance a request's matcher by the tokens it emitted this step.  A stop token may
    end the output in the middle of ``tokens``; what follows it is never emitted."""
    n = m.try_consume_tokens(list(tokens))
    if n != len(tokens) and not stopped:
        raise GrammarError(f"emitted token {tokens[n]} is not allowed by the grammar")
