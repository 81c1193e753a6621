"""Constrained decoding: lmnb's compressed FSM (SGLang paper, Section 4 and Appendix B) and
xgrammar as a second backend.

regex.py: pattern -> ByteFSM (DFA over UTF-8 bytes); token_bytes.py: token id -> bytes;
index.py: per-state allowed-token masks (TokenIndex, shared per (regex, tokenizer));
jump.py: forced strings of the compressed FSM and jump-forward re-tokenization;
protocol.py: the `Grammar` seam the scheduler and sampler use; grammar.py: the FSM's Grammar;
xgrammar_backend.py: xgrammar's (EBNF; regex and JSON schema with `grammar_backend="xgrammar"`);
factory.py: the Grammar of each request, from the runtime's backend.
"""

from lmnb.runtime.fsm.factory import GrammarFactory
from lmnb.runtime.fsm.index import TokenIndex, VocabTrie, get_token_index, vocab_trie
from lmnb.runtime.fsm.jump import CompressedFSM, JumpForward, JumpPlan
from lmnb.runtime.fsm.protocol import Grammar
from lmnb.runtime.fsm.regex import ByteFSM, InvalidRegexError, compile_regex
from lmnb.runtime.fsm.token_bytes import special_token_ids, token_byte_table

__all__ = [
    "ByteFSM", "CompressedFSM", "Grammar", "GrammarFactory", "InvalidRegexError", "JumpForward",
    "JumpPlan", "TokenIndex", "VocabTrie", "compile_regex", "get_token_index",
    "special_token_ids", "token_byte_table", "vocab_trie",
]
