"""select() scoring: spans at tokenization boundaries, the three methods, prefix caching; scores
equal a direct HF computation over the same token ids."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmnb.lang.choices import METHODS, RuntimeChoiceScorer, select_choice
from lmnb.runtime.engine import Runtime

TOL = 1e-4


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["llama-gqa"]


@pytest.fixture(scope="module")
def runtime(folder):
    with Runtime(folder, dtype="float32", device="cpu", max_total_tokens=4096,
                 check_integrity_each_step=True) as rt:
        yield rt


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- an independent reference: HF logits, log_softmax, the same token ids ----------------------
def _hf_logprobs(model, ids: list[int]) -> list[float]:
    """Logprobs of ids[1:], each given the ids before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _reference(model, tokenizer, prompt: str, choices: list[str]) -> dict:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True)

    prompt_ids = encode(prompt)
    full = [encode(prompt + choice) for choice in choices]
    start = min(_common_prefix_length(prompt_ids, ids) for ids in full)
    spans = [ids[start:] for ids in full]
    conditional = [_hf_logprobs(model, ids)[start - 1:] for ids in full]
    context = encode("") or [tokenizer.bos_token_id]
    unconditional = []
    for span in spans:
        values = _hf_logprobs(model, context + span) if len(context + span) > 1 else []
        unconditional.append(values if context else [None, *values])
    uln = []
    for cond, prior in zip(conditional, unconditional, strict=True):
        diffs = [c - u for c, u in zip(cond, prior, strict=True) if u is not None]
        uln.append(sum(diffs) / len(diffs) if diffs else 0.0)
    normalized = [sum(values) / len(values) for values in conditional]
    return {"start": start, "prompt_len": len(prompt_ids), "spans": spans,
            "texts": [[tokenizer.decode([t]) for t in span] for span in spans],
            "conditional": conditional, "normalized": normalized,
            "unconditional": unconditional, "uln": uln,
            "greedy": _greedy(conditional)}


def _first_argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def _greedy(rows: list[list[float]]) -> int:
    """Greedy decoding restricted to the choices; ended choices score -inf; near-equal logprobs
    (the same tokens computed in different sequences) are ties."""
    width = max(len(row) for row in rows)
    padded = [row + [-math.inf] * (width - len(row)) for row in rows]
    remaining = list(range(len(rows)))
    for j in range(width):
        best = max(padded[i][j] for i in remaining)
        remaining = [i for i in remaining if padded[i][j] >= best - TOL]
    return remaining[0]


def _close(got: list, expected: list) -> bool:
    return len(got) == len(expected) and all(
        (g is None and e is None) or (g is not None and e is not None and abs(g - e) < TOL)
        for g, e in zip(got, expected, strict=True))


def _check_against_reference(result, ref: dict) -> None:
    meta = result.meta_info
    assert meta["scored_from"] == ref["start"]
    assert meta["input_token_ids"] == ref["spans"]
    for got, expected, ids, texts in zip(meta["input_token_logprobs"], ref["conditional"],
                                         ref["spans"], ref["texts"], strict=True):
        assert _close([lp for lp, _, _ in got], expected), (got, expected)  # SGLang's triples
        assert [(t, text) for _, t, text in got] == list(zip(ids, texts, strict=True))
    assert meta["output_token_logprobs"] == [[] for _ in ref["spans"]]
    assert _close(meta["normalized_prompt_logprobs"], ref["normalized"])


CASES: dict[str, tuple[str, list[str]]] = {
    "prefix-choice": ("Is the sky blue? Answer:", ["Yes", "Yes, definitely"]),
    "space-choices": ("The sky is", [" red", " blue"]),
    "space-after-space": ("The sky is ", [" red", " blue"]),
    "merge": ("The sky is ", ["red", "blue"]),
    "merge-mixed": ("The sky is ", ["red", " blue", "green or grey"]),
    "multi-token": ("Q: Which fruit is yellow?\nA:", [" A banana", " An apple", " Kiwi",
                                                       " banana"]),
}
MERGES = {"merge", "merge-mixed"}


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_hf(case, runtime, hf):
    prompt, choices = CASES[case]
    ref = _reference(hf, runtime.tokenizer, prompt, choices)
    result = select_choice(RuntimeChoiceScorer(runtime), prompt, choices)
    _check_against_reference(result, ref)
    merged = result.meta_info["scored_from"] < ref["prompt_len"]
    assert merged == (case in MERGES)
    if merged:  # the merged token carries the prompt's trailing space: "Ġred", not "Ġ" + "red"
        span = result.meta_info["input_token_ids"][0]
        assert runtime.tokenizer.decode(span[:1]) == " red"


def test_prefix_choice_loses_greedy_ties(runtime):
    """"Yes" and "Yes, definitely" share the first token exactly; past "Yes" the short choice has
    ended (-inf), so greedy picks the long one whatever the model."""
    prompt, choices = CASES["prefix-choice"]
    result = select_choice(RuntimeChoiceScorer(runtime), prompt, choices, "greedy_token_selection")
    rows = result.meta_info["input_token_logprobs"]
    assert rows[0][0] == rows[1][0]  # the same (logprob, token, text)
    assert result.meta_info["greedy_logprob_matrix"][0][1:] == [-math.inf] * (len(rows[1]) - 1)
    assert result.index == 1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", CASES)
def test_methods_pick_the_argmax_of_their_own_score(case, method, runtime, hf):
    prompt, choices = CASES[case]
    ref = _reference(hf, runtime.tokenizer, prompt, choices)
    result = select_choice(RuntimeChoiceScorer(runtime), prompt, choices, method)
    _check_against_reference(result, ref)
    meta = result.meta_info
    assert meta["method"] == method
    if method == "token_length_normalized":
        expected = _first_argmax(ref["normalized"])
    elif method == "greedy_token_selection":
        expected = ref["greedy"]
    else:
        for got, want in zip(meta["unconditional_token_logprobs"], ref["unconditional"],
                             strict=True):
            assert _close([lp for lp, _, _ in got], want), (got, want)
        assert _close(meta["normalized_unconditional_prompt_logprobs"], ref["uln"])
        expected = _first_argmax(ref["uln"])
    assert result.index == expected
    assert result.choice == choices[expected]


class _CountingScorer(RuntimeChoiceScorer):
    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        self.calls: list[tuple[str, object]] = []

    def prompt_logprobs(self, input_ids: list[list[int]], start: int) -> list[list[float]]:
        self.calls.append(("prompt_logprobs", len(input_ids)))
        return super().prompt_logprobs(input_ids, start)

    def cache_prefix(self, input_ids: list[int]) -> None:
        self.calls.append(("cache_prefix", list(input_ids)))
        super().cache_prefix(input_ids)


@pytest.mark.parametrize("case", ["multi-token", "merge-mixed"])
def test_prefix_is_prefilled_once_then_hit_by_every_choice(case, runtime):
    prompt, choices = CASES[case]
    assert runtime.flush_cache()
    scorer = _CountingScorer(runtime)
    before = runtime.stats()
    result = select_choice(scorer, prompt, choices)
    after = runtime.stats()
    start = result.meta_info["scored_from"]
    prompt_ids = scorer.encode(prompt)
    assert scorer.calls == [("cache_prefix", prompt_ids[:start]),
                            ("prompt_logprobs", len(choices))]
    # Each choice reuses the prefix up to the token before its first scored one (whose logits
    # score position `start`); the prefill itself found an empty cache.
    assert after["cached_tokens"] - before["cached_tokens"] == len(choices) * (start - 1)
    assert after["prompt_tokens"] - before["prompt_tokens"] == start + sum(
        len(scorer.encode(prompt + choice)) for choice in choices)
    runtime.check_integrity()


# ---- semantics on a scripted scorer: no model ---------------------------------------------------
class _ScriptedScorer:
    """Characters are tokens; a token's logprob is `table[token]` (or `default`)."""

    def __init__(self, table: dict[str, float], *, bos: bool = False,
                 default: float = -5.0) -> None:
        self.table, self.bos, self.default = table, bos, default
        self.calls: list[tuple[list[list[int]], int]] = []

    def encode(self, text: str) -> list[int]:
        return ([0] if self.bos else []) + [ord(c) for c in text]

    def prompt_logprobs(self, input_ids: list[list[int]], start: int) -> list[list[float]]:
        self.calls.append(([list(ids) for ids in input_ids], start))
        return [[self.table.get(chr(t), self.default) if t else 0.0 for t in ids[start:]]
                for ids in input_ids]

    def cache_prefix(self, input_ids: list[int]) -> None:
        pass

    def unconditional_context(self) -> list[int]:
        return self.encode("")


def test_greedy_pads_ended_choices_with_minus_inf():
    scorer = _ScriptedScorer({"a": -1.0, "b": -1.0, "c": -9.0, "d": -0.5})
    # "ab" and "abc" tie on a, b; "abc" goes on (c is unlikely but beats an ended choice).
    assert select_choice(scorer, "x", ["ab", "abc"], "greedy_token_selection").choice == "abc"
    # The first token decides even if later ones are worse; equal rows: the first choice wins.
    assert select_choice(scorer, "x", ["dcc", "ad"], "greedy_token_selection").choice == "dcc"
    assert select_choice(scorer, "x", ["ab", "ba"], "greedy_token_selection").index == 0
    # The mean prefers the short choice.
    assert select_choice(scorer, "x", ["ab", "abc"]).choice == "ab"


def test_unconditional_excludes_tokens_without_context():
    table = {"a": -1.0, "b": -2.0}
    without_bos = select_choice(_ScriptedScorer(table), "x", ["ab", "b"],
                                "unconditional_likelihood_normalized")
    # Without BOS the span's first token has no unconditional logprob: left out of both sums;
    # "b" alone has nothing left and scores 0.
    assert without_bos.meta_info["unconditional_token_logprobs"] == \
        [[(None, ord("a"), None), (-2.0, ord("b"), None)], [(None, ord("b"), None)]]
    assert without_bos.meta_info["normalized_unconditional_prompt_logprobs"] == [0.0, 0.0]
    with_bos = _ScriptedScorer(table, bos=True)
    result = select_choice(with_bos, "x", ["ab", "b"], "unconditional_likelihood_normalized")
    assert [[lp for lp, _, _ in row] for row in
            result.meta_info["unconditional_token_logprobs"]] == [[-1.0, -2.0], [-2.0]]
    assert with_bos.calls[-1] == ([[0, ord("a"), ord("b")], [0, ord("b")]], 1)


def _boom(**kwargs) -> Callable:
    return lambda: select_choice(_ScriptedScorer({}), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt": "x", "choices": []}, "non-empty"),
    ({"prompt": "x", "choices": "ab"}, "non-empty"),
    ({"prompt": "x", "choices": ["a", 3]}, "strings"),
    ({"prompt": "x", "choices": ["a"], "method": "best"}, "token_length_normalized"),
    ({"prompt": "x", "choices": ["a", ""]}, "adds no tokens"),
    ({"prompt": "", "choices": ["a", "b"]}, "prompt"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _boom(**kwargs)()


# ---- the real model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    with Runtime(max_total_tokens=4096) as rt:
        yield rt


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2):
    result = select_choice(RuntimeChoiceScorer(smollm2), "The capital of France is",
                           [" Paris", " London", " a banana"])
    assert result.choice == " Paris"
    scores = result.meta_info["normalized_prompt_logprobs"]
    assert scores[0] > max(scores[1:]) + 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method",
                         ["greedy_token_selection", "unconditional_likelihood_normalized"])
def test_smollm2_other_methods_agree_on_the_capital(smollm2, method):
    result = select_choice(RuntimeChoiceScorer(smollm2), "The capital of France is",
                           [" Paris", " London", " a banana"], method)
    assert result.choice == " Paris"


def test_a_scoring_request_the_runtime_aborts_fails_the_select(folder):
    """Pinned prefixes hold the pool: the runtime aborts the scoring requests (out of KV), and
    the select says so rather than scoring from what came back; unpinned, it scores again."""
    from lmnb.lang.program_error import ProgramError

    with Runtime(folder, dtype="float32", device="cpu", max_total_tokens=160) as rt:
        pinned = " ".join(f"w{i}" for i in range(40))
        prompt = " ".join(f"q{i}" for i in range(25))
        assert len(rt.encode(pinned)) + len(rt.encode(prompt)) > 160 > len(rt.encode(pinned))
        pin = rt.pin_prefix(pinned)
        with pytest.raises(ProgramError, match="aborted a select's scoring request: out of KV"):
            select_choice(RuntimeChoiceScorer(rt), prompt, ["yes", "no"])
        assert rt.unpin_prefix(pin)
        assert select_choice(RuntimeChoiceScorer(rt), prompt, ["yes", "no"]).choice in {"yes",
                                                                                         "no"}
