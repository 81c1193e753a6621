"""N-gram speculative decoding: the n-gram index, the rejection sampler's distribution, the verify
step's distribution, and a tiny model run with and without `speculative_algorithm="NGRAM"`
(greedy, fp32 CPU): token-for-token identical outputs with stop strings, max_new_tokens,
logprobs, regexes (jump-forward on), the prefix cache, abort and the overlap schedule, with KV
slot integrity checked after every step."""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass, field

import pytest
import torch

import lmnb
from lmnb.lang.backends.local import LocalBackend
from lmnb.lang.token_trace import ORIGIN_INDEX
from lmnb.runtime.config import EngineConfig
from lmnb.runtime.core import SamplingParams
from lmnb.runtime.engine import Runtime
from lmnb.runtime.output.token_origins import GENERATED, SPECULATED, count_origin
from lmnb.runtime.sampling import Sampler
from lmnb.runtime.sampling.rejection import NO_DRAFT, accept_or_resample
from lmnb.runtime.speculative.gate import best_draft_length
from lmnb.runtime.speculative.ngram import MAX_CORPUS_SEQUENCES, NgramCorpus, TokenSequence
from lmnb.runtime.speculative.speculator import NgramSource, Speculator
from lmnb.runtime.speculative.verify import expanded_rows, verify_drafts

COPY_PROMPTS = [
    "apple banana cherry apple banana cherry apple banana cherry apple banana",
    "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return x + 1\ndef k(x):",
    '{"a": 1, "b": 2, "c": 3}\n{"a": 1, "b": 2, "c": 3}\n{"a": 1,',
]
_rng = random.Random(7)
RANDOM_PROMPTS = [" ".join(str(_rng.randint(0, 9999)) for _ in range(24)) for _ in range(2)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
            speculative_draft_policy="always", speculative_min_accept_rate=0.0)


@pytest.fixture(scope="module")
def runtimes(tiny_models):
    """(without, with NGRAM) over the same tiny model, KV integrity checked every step."""
    common = dict(dtype="float32", device="cpu", max_total_tokens=4096,
                  check_integrity_each_step=True)
    path = str(tiny_models["llama-gqa"])
    with Runtime(path, **common) as base, Runtime(path, **common, **SPEC) as spec:
        yield base, spec


def _spec_meta(outs):
    return [o["meta_info"] for o in outs]


# ---- the n-gram index ---------------------------------------------------------------------------
def test_ngram_continues_the_longest_most_recent_match() -> None:
    seq = TokenSequence([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3])
    match = seq.find(seq.tokens, k=3, max_depth=8, min_depth=2, prefer_frequent=False)
    assert match is not None and match.depth == 3 and match.tokens == [4, 9, 2]  # 1 2 3 -> 4
    shallow = TokenSequence([2, 3, 5, 8, 2, 3, 6, 8, 7, 2, 3])
    recent = shallow.find(shallow.tokens, k=2, max_depth=8, min_depth=2, prefer_frequent=False)
    assert recent is not None and recent.tokens == [6, 8]  # ties: the most recent
    assert shallow.find([4, 4], k=2, max_depth=8, min_depth=2, prefer_frequent=False) is None


def test_ngram_prob_prefers_the_frequent_continuation_and_loops_continue() -> None:
    seq = TokenSequence([7, 8, 1, 7, 8, 1, 7, 8, 2, 7, 8])
    frequent = seq.find(seq.tokens, k=1, max_depth=2, min_depth=2, prefer_frequent=True)
    assert frequent is not None and frequent.tokens == [1]
    loop = TokenSequence([5, 6, 5, 6])
    match = loop.find(loop.tokens, k=5, max_depth=4, min_depth=2, prefer_frequent=False,
                      periodic=True)
    assert match is not None and match.tokens == [5, 6, 5, 6, 5]


def test_corpus_keeps_recent_requests_within_capacity() -> None:
    corpus = NgramCorpus(capacity=10)
    corpus.add([1, 2, 3, 4, 5, 6])
    assert corpus.indexed == 0  # indexed at its first search
    found = corpus.find([9, 2, 3], k=3, max_depth=4, min_depth=2, prefer_frequent=False)
    assert found is not None and found.tokens == [4, 5, 6] and corpus.indexed == 1
    corpus.add([7, 7, 8, 8, 9, 9])  # 12 tokens > 10: the oldest sequence goes
    assert corpus.tokens == 6
    assert corpus.find([9, 2, 3], k=3, max_depth=4, min_depth=2, prefer_frequent=False) is None
    many = NgramCorpus(capacity=1000)
    for i in range(MAX_CORPUS_SEQUENCES + 1):
        many.add([100 + i, 1, 2, 3])
    match = many.find([0, 1, 2], k=1, max_depth=4, min_depth=2, prefer_frequent=False)
    assert match is not None and match.tokens == [3] and many.indexed == MAX_CORPUS_SEQUENCES
    many.add([5, 5])  # the 16th newest is no longer searched: its index goes
    assert many.indexed == MAX_CORPUS_SEQUENCES - 1 and many.tokens == 4 * 17 + 2


def test_draft_length_weighs_acceptance_against_verify_cost() -> None:
    assert best_draft_length(0.05, fixed=0.1, per_draft=0.2, longest=11) == 0
    assert best_draft_length(0.97, fixed=0.1, per_draft=0.02, longest=11) == 11
    assert 0 < best_draft_length(0.6, fixed=0.1, per_draft=0.15, longest=11) < 6


# ---- rejection sampling keeps the target distribution -------------------------------------------
def test_rejection_sampling_draws_exactly_the_target_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 100_000
    generator = torch.Generator().manual_seed(0)
    for draft in (0, 1, 3):
        u = torch.rand(2, n, generator=generator)
        accepted, token = accept_or_resample(probs.expand(n, 4), torch.full((n,), draft),
                                             u[0], u[1])
        final = torch.where(accepted, draft, token)
        freq = torch.bincount(final, minlength=4).float() / n
        assert 0.5 * (freq - probs).abs().sum() < 0.006, (draft, freq)
        assert abs(accepted.float().mean() - probs[draft]) < 0.006
    u = torch.rand(2, n, generator=generator)  # no draft (bonus position): a plain draw
    _, token = accept_or_resample(probs.expand(n, 4), torch.full((n,), NO_DRAFT), u[0], u[1])
    assert 0.5 * (torch.bincount(token, minlength=4) / n - probs).abs().sum() < 0.006


@dataclass
class _Row:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=lambda: [1])
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    rid: int | None = None


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}])
def test_verify_keeps_the_distribution_along_the_chain(params) -> None:
    """Requests with drafts [d0, d1] at every position: the first kept token follows the target
    at position 0, and after an accepted d0 the next follows the target at position 1."""
    vocab, n = 8, 12_000
    torch.manual_seed(0)
    logits3 = torch.randn(3, vocab) * 1.5
    sampler = Sampler(vocab, eos_token_ids=[])
    sampling_params = SamplingParams(**params)
    target = sampler.distribution(logits3, sampler.batch_info([_Row(sampling_params)] * 3, "cpu"))
    d0, d1 = int(target[0].argmax()), int(target[1].argsort()[-2])
    rows = [_Row(sampling_params) for _ in range(n)]
    drafts = [[d0, d1]] * n
    info = sampler.batch_info(expanded_rows(rows, drafts), "cpu")
    out = verify_drafts(sampler, logits3.repeat(n, 1), info, None, drafts)
    first = torch.tensor([t[0] for t in out.tokens])
    freq0 = torch.bincount(first, minlength=vocab) / n
    assert 0.5 * (freq0 - target[0]).abs().sum() < 0.02
    after = torch.tensor([t[1] for t in out.tokens if t[0] == d0 and len(t) > 1])
    freq1 = torch.bincount(after, minlength=vocab) / len(after)
    assert len(after) > 2000 and 0.5 * (freq1 - target[1]).abs().sum() < 0.04


def test_a_request_that_cannot_draw_fails_alone_in_its_verify_pass() -> None:
    """Greedy rows: request 0 accepts its draft and draws; request 1's first position is all
    -inf (nothing can be drawn): it alone is named in `failed`, with empty lists."""
    vocab = 8
    logits = torch.randn(4, vocab)
    logits[0, 3], logits[1, 5] = 50.0, 50.0  # request 0: draft 3 accepted, then 5
    logits[2:] = float("-inf")  # request 1's two positions
    sampler = Sampler(vocab, eos_token_ids=[])
    params = SamplingParams(temperature=0.0)
    drafts = [[3], [2]]
    info = sampler.batch_info(expanded_rows([_Row(params), _Row(params)], drafts), "cpu")
    out = verify_drafts(sampler, logits, info, None, drafts)
    assert out.tokens == [[3, 5], []] and list(out.failed) == [1]
    assert "every token is masked" in out.failed[1]


def test_verify_judges_drafts_by_the_biased_logits() -> None:
    """A greedy request whose bias bans its raw argmax: the draft equal to that argmax is
    rejected and the biased argmax kept (verify reads `Sampler.adjusted_logits`)."""
    vocab = 8
    logits = torch.zeros(2, vocab)
    logits[:, 3], logits[:, 5] = 10.0, 9.0
    sampler = Sampler(vocab, eos_token_ids=[])
    drafts = [[3]]
    plain = sampler.batch_info(expanded_rows([_Row(SamplingParams(temperature=0.0))], drafts),
                               "cpu")
    assert verify_drafts(sampler, logits, plain, None, drafts).tokens == [[3, 3]]
    banned = SamplingParams(temperature=0.0, logit_bias={3: -100.0})
    info = sampler.batch_info(expanded_rows([_Row(banned)], drafts), "cpu")
    assert verify_drafts(sampler, logits, info, None, drafts).tokens == [[5]]


# ---- the runtime --------------------------------------------------------------------------------
def test_greedy_outputs_are_identical_and_drafts_are_accepted(runtimes) -> None:
    base, spec = runtimes
    prompts = COPY_PROMPTS + RANDOM_PROMPTS
    want = base.generate(prompts, GREEDY)
    got = spec.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["text"] for o in got] == [o["text"] for o in want]
    accepted = sum(m.get("spec_accept_token_num", 0) for m in _spec_meta(got))
    assert accepted > 0
    one = spec.generate(COPY_PROMPTS[0], GREEDY)  # batch 1, and again from the prefix cache
    again = spec.generate(COPY_PROMPTS[0], GREEDY)
    assert one["output_ids"] == again["output_ids"] == want[0]["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    meta = one["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["forward_passes"] < meta["completion_tokens"]
    assert meta["spec_accept_length"] == pytest.approx(
        (meta["spec_accept_token_num"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"])
    stats = spec.stats()["speculative"]
    assert stats["verify_passes"] > 0 and stats["accepted_tokens"] > 0
    spec.check_integrity()


def test_logit_bias_outputs_are_identical_with_speculation(runtimes) -> None:
    """The token the first copy prompt's greedy output repeats most, banned, and a token of the
    prompt forced on another: the outputs are those without speculation (drafts accepted)."""
    base, spec = runtimes
    plain = base.generate(COPY_PROMPTS[0], GREEDY)["output_ids"]
    common = max(set(plain), key=plain.count)
    apple = base.tokenizer.encode(" apple", add_special_tokens=False)[0]
    params = [{**GREEDY, "logit_bias": {common: -100.0}}, GREEDY,
              {**GREEDY, "logit_bias": {apple: 8.0}}]
    want = base.generate(COPY_PROMPTS, params)
    got = spec.generate(COPY_PROMPTS, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert common not in got[0]["output_ids"]
    assert got[1]["output_ids"] == base.generate(COPY_PROMPTS[1], GREEDY)["output_ids"]
    assert sum(m.get("spec_accept_token_num", 0) for m in _spec_meta(got)) > 0
    spec.check_integrity()


def test_accepted_drafts_are_reported_as_speculated_tokens(runtimes) -> None:
    base, spec = runtimes
    want = base.generate(COPY_PROMPTS[0], GREEDY)["output_ids"]
    out = spec.generate(COPY_PROMPTS[0], GREEDY, return_token_origins=True)
    meta = out["meta_info"]
    spans = meta["output_token_origins"]
    speculated = count_origin(spans, SPECULATED)
    # a chain cut by max_new_tokens appends fewer than the verify pass accepted
    assert 0 < speculated <= meta["spec_accept_token_num"]
    assert speculated + count_origin(spans, GENERATED) == meta["completion_tokens"]
    assert out["output_ids"] == want
    streamed = list(spec.generate(COPY_PROMPTS[0], GREEDY, return_token_origins=True,
                                  stream=True))
    assert any(count_origin(c["meta_info"].get("output_token_origins", []), SPECULATED)
               for c in streamed[:-1])  # live chunks already say so
    # a traced program (its gen awaited on the program loop) shows them as speculated cells

    @lmnb.function
    def copy(s):
        s += COPY_PROMPTS[0]
        s += lmnb.gen("out", max_tokens=GREEDY["max_new_tokens"], temperature=0)

    state = copy.run(backend=LocalBackend(spec), token_view=True)
    gen_meta = state.get_meta_info("out")
    cells = state.token_trace.cells()
    traced = sum(1 for cell in cells if cell[1] == ORIGIN_INDEX[SPECULATED])
    assert traced == count_origin(gen_meta["output_token_origins"], SPECULATED) > 0
    spec.check_integrity()


def test_stop_strings_and_max_new_tokens_cut_inside_accepted_chains(runtimes) -> None:
    base, spec = runtimes
    prompts = COPY_PROMPTS[:2]
    full = base.generate(prompts, GREEDY)
    stops = [full[0]["text"][15:19], full[1]["text"][12:15]]
    cases = [[{**GREEDY, "stop": [s]} for s in stops],
             [{**GREEDY, "stop_regex": [re.escape(s)]} for s in stops],
             [{**GREEDY, "max_new_tokens": m} for m in (1, 7)],
             [{**GREEDY, "max_new_tokens": 13}, {**GREEDY, "stop_token_ids": [
                 full[1]["output_ids"][9]]}]]
    for params in cases:
        want = base.generate(prompts, params)
        got = spec.generate(prompts, params)
        for w, g, p in zip(want, got, params, strict=True):
            assert g["text"] == w["text"] and g["output_ids"] == w["output_ids"]
            assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
            assert g["meta_info"]["completion_tokens"] <= p["max_new_tokens"]
    spec.check_integrity()


def test_logprobs_are_the_targets_for_accepted_tokens(runtimes) -> None:
    base, spec = runtimes
    params = {**GREEDY, "max_new_tokens": 24}
    kwargs = dict(return_logprob=True, top_logprobs_num=2)
    want = base.generate(COPY_PROMPTS[0], params, **kwargs)
    got = spec.generate(COPY_PROMPTS[0], params, **kwargs)
    assert got["meta_info"]["spec_accept_token_num"] > 0
    w, g = want["meta_info"], got["meta_info"]
    assert [t for _, t in g["output_token_logprobs"]] == [t for _, t in w["output_token_logprobs"]]
    assert [lp for lp, _ in g["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _ in w["output_token_logprobs"]], abs=1e-4)
    assert [[t for _, t in top] for top in g["output_top_logprobs"]] == \
        [[t for _, t in top] for top in w["output_top_logprobs"]]


def test_token_ids_logprobs_are_the_targets_for_accepted_tokens(runtimes) -> None:
    """A verify pass reports the named ids' logprobs at each kept token, accepted drafts
    included: those of the runtime without speculation."""
    base, spec = runtimes
    params = {**GREEDY, "max_new_tokens": 24}
    kwargs = dict(return_logprob=True, token_ids_logprob=[11, 4, 11])
    want = base.generate(COPY_PROMPTS[0], params, **kwargs)
    got = spec.generate(COPY_PROMPTS[0], params, **kwargs)
    assert got["meta_info"]["spec_accept_token_num"] > 0
    assert got["output_ids"] == want["output_ids"]
    g, w = (r["meta_info"]["output_token_ids_logprobs"] for r in (got, want))
    assert len(g) == len(got["output_ids"])
    assert [[t for _, t in row] for row in g] == [[11, 4, 11]] * len(g)
    assert [lp for row in g for lp, _ in row] == pytest.approx(
        [lp for row in w for lp, _ in row], abs=1e-4)


def test_regex_drafts_pass_the_fsm_and_jump_forward_still_applies(runtimes) -> None:
    base, spec = runtimes
    regexes = [r"((apple|banana|cherry) ){4,12}",
               r'\{"a": [0-9]{1,3}, "b": [0-9]{1,3}, "c": [0-9]{1,3}\}']
    params = [{**GREEDY, "regex": r} for r in regexes]
    prompts = [COPY_PROMPTS[0], COPY_PROMPTS[2]]
    want = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    for w, g, pattern in zip(want, got, regexes, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert re.fullmatch(pattern, g["text"])
    assert got[1]["meta_info"]["jump_forward_steps"] > 0
    assert sum(m.get("spec_verify_ct", 0) for m in _spec_meta(got)) > 0
    spec.check_integrity()


def test_sampling_with_speculation_stays_in_the_support_and_frees_kv(runtimes) -> None:
    _, spec = runtimes
    outs = spec.generate([COPY_PROMPTS[0]] * 4, {"temperature": 0.5, "top_k": 5,
                                                 "max_new_tokens": 32},
                         return_logprob=True, top_logprobs_num=5)
    assert sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs) > 0
    for out in outs:  # accepted drafts and resampled tokens alike lie in the top-k support
        meta = out["meta_info"]
        for (_, token), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                   strict=True):
            assert token in {t for _, t in top}
    stream = spec.generate(COPY_PROMPTS[1], {**GREEDY, "max_new_tokens": 200}, stream=True)
    next(stream)
    stream.close()  # aborts mid-generation
    spec.check_integrity()
    stats = spec.stats()
    assert stats["free_tokens"] + stats["tree_tokens"] == stats["max_total_tokens"]


def test_overlap_schedule_batch_limit_and_decode_form_verify_compose(tiny_models,
                                                                    runtimes) -> None:
    """Overlap forced on the CPU, chunked prefill, at most 2 requests speculate, and verify
    passes run as decode batches (one row per position: the form CUDA graphs replay)."""
    base, _ = runtimes
    prompts = COPY_PROMPTS + RANDOM_PROMPTS[:1]
    want = base.generate(prompts, GREEDY)
    with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                 max_total_tokens=4096, check_integrity_each_step=True, chunked_prefill_size=16,
                 disable_overlap_schedule=False, speculative_max_batch_size=2,
                 speculative_verify_mode="decode", **SPEC) as rt:
        got = rt.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        one = rt.generate(COPY_PROMPTS[2], GREEDY)
        assert one["output_ids"] == want[2]["output_ids"]
        stats = rt.stats()
    assert stats["overlap_schedule"] and stats["overlapped_passes"] > 0
    assert stats["speculative"]["large_batch_steps"] > 0
    assert stats["speculative"]["verify_passes"] > 0


def test_a_batch_over_the_limit_keeps_the_pipeline_and_does_no_speculative_work(
        tiny_models, runtimes, monkeypatch) -> None:
    """Above `speculative_max_batch_size` a runtime with NGRAM configured runs like one without:
    every decode pass but the first is overlapped, nothing is drafted, no gate is made and no
    token is indexed (finished requests join the corpus unindexed); a request alone afterwards
    drafts from them (indexed then, in one go) with the same greedy output."""
    base, _ = runtimes
    prompts = RANDOM_PROMPTS + COPY_PROMPTS[:2]
    params = {**GREEDY, "max_new_tokens": 12}
    want = base.generate(prompts, params)
    calls = {"draft": 0, "gate": 0, "indexed": 0}

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            calls[name] += len(args[0]) if name == "indexed" else 1
            return fn(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(NgramSource, "draft", counted("draft", NgramSource.draft))
    monkeypatch.setattr(Speculator, "_gate", counted("gate", Speculator._gate))
    monkeypatch.setattr(TokenSequence, "extend", counted("indexed", TokenSequence.extend))
    with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                 max_total_tokens=4096, disable_overlap_schedule=False,
                 speculative_max_batch_size=len(prompts) - 1, **SPEC) as rt:
        before = rt.stats()
        # The scheduler waits between steps until all requests are in: one batch of 4 from
        # the first step (no early step with fewer requests, which would speculate).
        gate, holding = threading.Event(), threading.Event()
        hold = threading.Thread(target=rt._scheduler.call,
                                args=(lambda: (holding.set(), gate.wait(30)),))
        hold.start()
        assert holding.wait(30)
        try:
            stream = rt.generate(prompts, params, stream=True)
        finally:
            gate.set()
            hold.join()
        got = stream.results()
        after = rt.stats()
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert calls == {"draft": 0, "gate": 0, "indexed": 0}
        passes = after["forward_passes"] - before["forward_passes"]  # 1 prefill + 11 decodes
        assert passes == 12
        assert after["overlapped_passes"] - before["overlapped_passes"] == passes - 2
        spec = after["speculative"]
        assert spec["state"].startswith("off: batch of 4") and spec["verify_passes"] == 0
        assert spec["corpus_tokens"] > 0 and spec["corpus_indexed_sequences"] == 0
        base_one = base.generate(COPY_PROMPTS[1], GREEDY)
        one = rt.generate(COPY_PROMPTS[1], GREEDY)  # batch 1: drafts again
        assert one["output_ids"] == base_one["output_ids"]
        assert calls["draft"] > 0 and one["meta_info"]["spec_accept_token_num"] > 0
        assert rt.stats()["speculative"]["corpus_indexed_sequences"] == len(prompts)


def test_speculative_options_are_validated() -> None:
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineConfig(speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="speculative_num_steps"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_num_steps=3)
    with pytest.raises(ValueError, match="speculative_num_steps \\+ 1"):
        EngineConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="x",
                     speculative_num_steps=3, speculative_num_draft_tokens=8)
    standalone = EngineConfig(speculative_algorithm="STANDALONE",
                              speculative_draft_model_path="x", speculative_num_steps=3)
    assert standalone.speculative().max_draft_tokens == 3
    with pytest.raises(ValueError, match="speculative_ngram_match_type"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_match_type="DFS")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="speculative_verify_mode"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_verify_mode="tree")
    # a continuation matches >= 2 context tokens: a depth of 1 would never draft
    with pytest.raises(ValueError, match="speculative_ngram_max_trie_depth must be >= 2"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_max_trie_depth=1)
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(speculative_algorithm="NGRAM", tp_size=2)
    from lmnb.__main__ import build_parser

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "NGRAM",
                                      "--speculative-num-draft-tokens", "6"])
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 6)
    config = EngineConfig(speculative_algorithm="ngram").speculative()
    assert config is not None and config.max_draft_tokens == 11  # SGLang's default of 12
    assert EngineConfig().speculative() is None


def test_cache_dashboard_shows_the_acceptance_rate(runtimes) -> None:
    pytest.importorskip("anywidget")
    from lmnb.widgets.cache_dashboard import CacheDashboard

    _, spec = runtimes
    spec.generate(COPY_PROMPTS[0], GREEDY)
    dash = CacheDashboard(spec, interval_s=None, since_runtime_start=True)
    assert dash.stats["speculative"]["accepted_tokens"] > 0
    assert "draft tokens accepted" in repr(dash)
    dash.close()


@pytest.mark.parametrize("draft", ["llama-gqa", "llama-mha"])
def test_standalone_draft_model_keeps_greedy_outputs(tiny_models, runtimes, draft) -> None:
    """STANDALONE with the target itself as the draft (every draft accepted) and with another
    model (drafts rejected): the outputs of plain decoding, draft KV accounted every step."""
    base, _ = runtimes
    prompts = [COPY_PROMPTS[0], RANDOM_PROMPTS[0], COPY_PROMPTS[2]]
    params = [GREEDY, {**GREEDY, "stop": ["7"]},
              {**GREEDY, "regex": r'\{"a": [0-9]{1,3}, "b": [0-9]{1,3}, "c": [0-9]{1,3}\}'}]
    want = base.generate(prompts, params)
    with Runtime(str(tiny_models["llama-gqa"]), dtype="float32", device="cpu",
                 max_total_tokens=4096, check_integrity_each_step=True,
                 speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=str(tiny_models[draft]), speculative_num_steps=3,
                 speculative_draft_policy="always", speculative_min_accept_rate=0.0) as rt:
        got = rt.generate(prompts, params)
        sampled = rt.generate(COPY_PROMPTS[1], {"temperature": 0.9, "max_new_tokens": 16,
                                                "ignore_eos": True})
        stats = rt.stats()["speculative"]
        rt.check_integrity()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert sampled["meta_info"]["completion_tokens"] == 16
    assert stats["draft_passes"] > 0 and stats["draft_kv_tokens"] == 0
    rates = [o["meta_info"]["spec_accept_rate"] for o in got[:2]]
    if draft == "llama-gqa":  # unconstrained greedy requests accept (all but near-tie) drafts
        assert min(rates) > 0.9
    else:  # random models that disagree
        assert max(rates) < 0.5


def test_verify_and_draft_rows_through_the_padded_graph_path(tiny_models, runtimes,
                                                             monkeypatch) -> None:
    """The CUDA-graph path on the CPU: a graph runner that captures nothing and runs each padded
    static batch eagerly through the backend's replay hooks (`capture=False`), rows up to 16.
    NGRAM verify passes as decode rows padded to the ladder (one request: <= 6 rows -> 8; three:
    up to 18 rows, one eager EXTEND past 16), and STANDALONE's catch-up passes as rows: the
    outputs of plain decoding."""
    import functools

    from lmnb.runtime import model_runner
    from lmnb.runtime.graph_runner import DecodeGraphRunner

    monkeypatch.setattr(model_runner, "graph_max_bs", lambda **_: 16)
    monkeypatch.setattr(model_runner, "DecodeGraphRunner",
                        functools.partial(DecodeGraphRunner, capture=False))
    base, _ = runtimes
    prompts = COPY_PROMPTS
    want = base.generate(prompts, GREEDY)
    path = str(tiny_models["llama-gqa"])
    common = dict(dtype="float32", device="cpu", max_total_tokens=4096, context_length=256,
                  check_integrity_each_step=True)
    with Runtime(path, **common, **SPEC) as rt:
        got = rt.generate(prompts, GREEDY)
        one = rt.generate(COPY_PROMPTS[2], GREEDY)
        stats = rt.stats()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert one["output_ids"] == want[2]["output_ids"]
    verifies = stats["speculative"]["timed_passes"]["verify"]
    assert stats["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert 0 < stats["verify_graph_replays"] <= verifies
    assert stats["cuda_graph_replays"] > stats["verify_graph_replays"]  # decode steps too
    with Runtime(path, **common, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=path, speculative_num_steps=3,
                 speculative_draft_policy="always") as rt:
        got = rt.generate(prompts[:2], GREEDY)
        stats = rt.stats()["speculative"]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want[:2]]
    assert stats["draft_row_passes"] > 0 and stats["accept_rate"] > 0.9
    assert stats["draft_kv_tokens"] == 0


def test_graph_ladder_reaches_the_largest_verify_pass() -> None:
    """Decode graphs capped at 8 requests still reach the rows of a verify pass of
    `speculative_max_batch_size` requests x `speculative_num_draft_tokens` (at most 256)."""
    from lmnb.runtime.graph_runner import graph_max_bs
    from lmnb.runtime.speculative.config import SpeculativeConfig

    options = dict(device_type="cuda", disable_cuda_graph=False, backend_name="triton",
                   supports_capture=True, max_running_requests=64)
    rows = SpeculativeConfig(num_draft_tokens=12, max_batch_size=8).max_verify_rows
    assert rows == 96
    assert graph_max_bs(cuda_graph_max_bs=8, **options) == 8
    assert graph_max_bs(cuda_graph_max_bs=8, verify_rows=rows, **options) == 96
    assert graph_max_bs(cuda_graph_max_bs=None, verify_rows=rows, **options) == 96
    assert graph_max_bs(cuda_graph_max_bs=None, verify_rows=4096, **options) == 256
    assert graph_max_bs(cuda_graph_max_bs=None, verify_rows=rows,
                        **{**options, "device_type": "cpu"}) == 0
    extend = SpeculativeConfig(verify_mode="extend")
    assert extend.max_verify_rows == 0


def test_a_seeded_sampled_request_gives_the_same_text_with_a_corpus_of_its_own(runtimes) -> None:
    """A seeded sampled request does not draft: its text would otherwise follow drafts that the
    NGRAM corpus of earlier requests (here: its own first run) makes different."""
    base, spec = runtimes
    params = {"temperature": 0.7, "top_k": 5, "max_new_tokens": 40, "seed": 11}
    want = base.generate(COPY_PROMPTS[0], params)["output_ids"]
    assert spec.generate(COPY_PROMPTS[0], params)["output_ids"] == want
    assert spec.generate(COPY_PROMPTS[0], params)["output_ids"] == want  # now in the corpus


def test_a_seeded_sampled_request_beside_drafting_requests_gives_the_same_text(runtimes) -> None:
    """A seeded sampled request that does not draft, in a verify pass of requests that do,
    draws its token as a decode step would (its seed's stream does not follow the batch)."""
    base, spec = runtimes
    seeded = {"temperature": 0.7, "top_k": 5, "max_new_tokens": 40, "seed": 11}
    want = base.generate(COPY_PROMPTS[1], seeded)["output_ids"]
    outs = spec.generate([COPY_PROMPTS[0], COPY_PROMPTS[1]], [GREEDY, seeded])
    assert outs[0]["meta_info"].get("spec_verify_ct", 0) > 0
    assert outs[1]["output_ids"] == want
    spec.check_integrity()
