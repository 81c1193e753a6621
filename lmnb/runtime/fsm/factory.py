"""`GrammarFactory`: each constrained request's `Grammar`, from the backend the runtime was given.

`grammar_backend="lmnb"` (the default): regex and JSON schema through lmnb's compressed FSM (masks
cached per state and shared by every request with the same pattern; jump-forward); EBNF through
xgrammar, the only backend that reads grammars. `"xgrammar"`: all three through xgrammar.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from lmnb.params import InvalidRequestError, SamplingParams
from lmnb.runtime.config import GRAMMAR_BACKENDS
from lmnb.runtime.fsm.grammar import RequestGrammar
from lmnb.runtime.fsm.index import get_token_index
from lmnb.runtime.fsm.json_schema import InvalidSchemaError, json_schema_to_regex
from lmnb.runtime.fsm.protocol import Grammar
from lmnb.runtime.fsm.regex import InvalidRegexError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmnb.runtime.fsm.xgrammar_backend import XGrammarCompiler


def constraint(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's output constraint: ('regex' | 'json_schema' | 'ebnf', its
    text; a schema as JSON text), or None."""
    if params.ebnf is not None:
        return "ebnf", params.ebnf
    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        schema = params.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    return None


class GrammarFactory:
    """Builds grammars for one tokenizer and model vocabulary. xgrammar (imported on first use)
    compiles once per (kind, text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int,
                 eos_token_ids: set[int], backend: str = "lmnb") -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar_backend {backend!r}; choose one of: "
                             f"{', '.join(GRAMMAR_BACKENDS)}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.backend = backend
        self._xgrammar: XGrammarCompiler | None = None
        self._lock = threading.Lock()

    def make(self, params: SamplingParams) -> Grammar | None:
        """The request's Grammar, None without a constraint; InvalidRequestError for a bad
        regex, schema or grammar (naming the problem)."""
        found = constraint(params)
        if found is None:
            return None
        kind, text = found
        if kind == "ebnf" or self.backend == "xgrammar":
            compiler = self.xgrammar()
            from lmnb.runtime.fsm.xgrammar_backend import InvalidGrammarError

            try:
                return compiler.matcher(kind, text)
            except InvalidGrammarError as error:
                raise InvalidRequestError(str(error)) from None
        try:
            pattern = text if kind == "regex" else json_schema_to_regex(text)
            index = get_token_index(pattern, self.tokenizer, vocab_size=self.vocab_size)
        except (InvalidRegexError, InvalidSchemaError) as error:
            raise InvalidRequestError(str(error)) from None
        return RequestGrammar(index, pattern)

    def xgrammar(self) -> XGrammarCompiler:
        """The xgrammar compiler of this tokenizer, built on first use (~0.1 s for a 49k
        vocabulary)."""
        with self._lock:
            if self._xgrammar is None:
                try:
                    from lmnb.runtime.fsm.xgrammar_backend import XGrammarCompiler
                except ImportError as error:
                    raise InvalidRequestError(
                        "EBNF grammars (and grammar_backend='xgrammar') need the xgrammar "
                        f"package: pip install xgrammar ({error})") from None
                self._xgrammar = XGrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)
            return self._xgrammar
