"""Constrained decoding with a compressed FSM (SGLang paper, Section 4 and Appendix B).

regex.py: pattern -> ByteFSM (DFA over UTF-8 bytes); token_bytes.py: token id -> bytes;
index.py: per-state allowed-token masks (TokenIndex, shared per (regex, tokenizer));
jump.py: forced strings of the compressed FSM and jump-forward re-tokenization.
"""

from lmnb.runtime.fsm.index import TokenIndex, VocabTrie, get_token_index, vocab_trie
from lmnb.runtime.fsm.jump import CompressedFSM, JumpForward, JumpPlan
from lmnb.runtime.fsm.regex import ByteFSM, InvalidRegexError, compile_regex
from lmnb.runtime.fsm.token_bytes import special_token_ids, token_byte_table

__all__ = [
    "ByteFSM", "CompressedFSM", "InvalidRegexError", "JumpForward", "JumpPlan", "TokenIndex",
    "VocabTrie", "compile_regex", "get_token_index", "special_token_ids", "token_byte_table",
    "vocab_trie",
]
