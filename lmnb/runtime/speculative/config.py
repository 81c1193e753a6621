"""`SpeculativeConfig`: the speculative-decoding options of `EngineConfig` (SGLang's names),
validated; no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALGORITHMS = ("NGRAM", "STANDALONE")
DEFAULT_NUM_STEPS = 4  # STANDALONE: draft model passes (draft tokens) per verify pass
MATCH_TYPES = ("BFS", "PROB")
DRAFT_POLICIES = ("adaptive", "always")
VERIFY_MODES = ("auto", "extend", "decode")
DEFAULT_NUM_DRAFT_TOKENS = 12  # SGLang's default for NGRAM


NGRAM_MIN_MATCH = 2  # context tokens a continuation must match (one token alone rarely predicts)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`num_draft_tokens` counts, as in SGLang, the verify pass's positions: the request's last
    token plus `num_draft_tokens - 1` draft tokens. lmnb drafts a chain (one continuation), so the
    BFS breadths only bound nothing wider than 1; they are validated and kept for SGLang command
    lines. `max_batch_size` and `min_accept_rate` are lmnb's: decode batches with more requests,
    and requests whose recent drafts are accepted less often, decode without speculation;
    `draft_policy` "adaptive" sizes each chain by the request's recent acceptance and the measured
    cost of verify passes (so its drafts depend on timing), "always" drafts the longest chain the
    n-gram index gives (deterministic; ablations and tests). `verify_mode`: a verify pass runs as
    one EXTEND over each request's positions ("extend"), or as a DECODE batch with one row per
    position, all rows of a request reading its KV row up to their own position ("decode": the
    decode CUDA graphs and shared-prefix decode serve it); "auto" is "decode" when decode graphs
    are captured."""

    algorithm: str = "NGRAM"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    draft_model_path: str | None = None  # STANDALONE: the draft model (same tokenizer)
    ngram_min_bfs_breadth: int = 1
    ngram_max_bfs_breadth: int = 10
    ngram_match_type: str = "BFS"
    ngram_max_trie_depth: int = 18
    ngram_capacity: int = 10_000_000
    max_batch_size: int = 8
    min_accept_rate: float = 0.15
    draft_policy: str = "adaptive"
    verify_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown speculative_algorithm {self.algorithm!r}; choose one of: "
                             f"{', '.join(ALGORITHMS)}")
        if (self.algorithm == "STANDALONE") != (self.draft_model_path is not None):
            raise ValueError("speculative_draft_model_path is needed with (and only with) "
                             "speculative_algorithm='STANDALONE'")
        _at_least("speculative_num_draft_tokens", self.num_draft_tokens, 2)
        _at_least("speculative_ngram_min_bfs_breadth", self.ngram_min_bfs_breadth, 1)
        _at_least("speculative_ngram_max_bfs_breadth", self.ngram_max_bfs_breadth,
                  self.ngram_min_bfs_breadth)
        _at_least("speculative_ngram_max_trie_depth", self.ngram_max_trie_depth, NGRAM_MIN_MATCH)
        _at_least("speculative_ngram_capacity", self.ngram_capacity, 1)
        _at_least("speculative_max_batch_size", self.max_batch_size, 1)
        if self.ngram_match_type not in MATCH_TYPES:
            raise ValueError(f"speculative_ngram_match_type must be one of "
                             f"{', '.join(MATCH_TYPES)}, got {self.ngram_match_type!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative_draft_policy must be one of "
                             f"{', '.join(DRAFT_POLICIES)}, got {self.draft_policy!r}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"speculative_verify_mode must be one of "
                             f"{', '.join(VERIFY_MODES)}, got {self.verify_mode!r}")
        rate = self.min_accept_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_min_accept_rate must be in [0, 1], got {rate!r}")

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens per verify pass (the last token is verified with them)."""
        return self.num_draft_tokens - 1

    @property
    def max_verify_rows(self) -> int:
        """Rows of the largest verify pass in decode form (every speculating request with a
        full chain), which the decode CUDA graphs should reach; 0 in "extend" form."""
        return 0 if self.verify_mode == "extend" else self.max_batch_size * self.num_draft_tokens

    @classmethod
    def from_options(cls, *, algorithm: Any, num_draft_tokens: Any, num_steps: Any,
                     draft_model_path: Any, min_bfs_breadth: Any,
                     max_bfs_breadth: Any, match_type: Any, max_trie_depth: Any, capacity: Any,
                     max_batch_size: Any, min_accept_rate: Any,
                     draft_policy: Any, verify_mode: Any) -> SpeculativeConfig | None:
        """From `EngineConfig`'s fields; None when `algorithm` is None (no speculation)."""
        if algorithm is None:
            return None
        if not isinstance(algorithm, str):
            raise ValueError(f"speculative_algorithm must be a name or None, got {algorithm!r}")
        algorithm = algorithm.upper()
        if algorithm == "STANDALONE":  # a chain: num_draft_tokens = num_steps + 1 (SGLang)
            if num_steps is not None:
                _at_least("speculative_num_steps", num_steps, 1)
                if num_draft_tokens not in (None, num_steps + 1):
                    raise ValueError(
                        f"speculative_num_draft_tokens must be speculative_num_steps + 1 = "
                        f"{num_steps + 1} (a chain), got {num_draft_tokens}")
                num_draft_tokens = num_steps + 1
            elif num_draft_tokens is None:
                num_draft_tokens = DEFAULT_NUM_STEPS + 1
        elif num_steps is not None:
            raise ValueError("speculative_num_steps applies to STANDALONE (a draft model)")
        if draft_model_path is not None and not isinstance(draft_model_path, str):
            raise ValueError(f"speculative_draft_model_path must be a path, "
                             f"got {draft_model_path!r}")
        return cls(algorithm=algorithm,
                   num_draft_tokens=(DEFAULT_NUM_DRAFT_TOKENS if num_draft_tokens is None
                                     else num_draft_tokens),
                   draft_model_path=draft_model_path,
                   ngram_min_bfs_breadth=min_bfs_breadth, ngram_max_bfs_breadth=max_bfs_breadth,
                   ngram_match_type=match_type, ngram_max_trie_depth=max_trie_depth,
                   ngram_capacity=capacity, max_batch_size=max_batch_size,
                   min_accept_rate=min_accept_rate, draft_policy=draft_policy,
                   verify_mode=verify_mode)


def _at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
