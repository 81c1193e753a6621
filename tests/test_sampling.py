import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import SampleOutput, Sampler, pack_mask
from lmnb.runtime.scheduler import ReqState

EOS = 0


def make_req(prompt: tuple[int, ...] = (1, 2, 3), output: tuple[int, ...] = (),
             seed: int | None = None, top_logprobs_num: int = 0, return_logprob: bool = True,
             token_ids_logprob: list[int] | None = None, **params: object) -> ReqState:
    req = Req(origin_input_ids=list(prompt), sampling_params=SamplingParams(**params),
              top_logprobs_num=top_logprobs_num, return_logprob=return_logprob,
              token_ids_logprob=token_ids_logprob)
    req.output_ids = list(output)
    state = ReqState(req)
    if seed is not None:
        state.generator = torch.Generator().manual_seed(seed)
    return state


def sample(vocab: int, logits: torch.Tensor, reqs: list[Req],
           vocab_mask: torch.Tensor | None = None) -> SampleOutput:
    sampler = Sampler(vocab, {EOS})
    bitmask = None if vocab_mask is None else pack_mask(vocab_mask)
    out = sampler(logits, sampler.batch_info(reqs, logits.device), bitmask)
    out.synchronize()
    return out


def distribution(vocab: int, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    sampler = Sampler(vocab, {EOS})
    return sampler.distribution(logits, sampler.batch_info(reqs, logits.device))


def adjusted_logits(vocab: int, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    sampler = Sampler(vocab, {EOS})
    return sampler.adjusted_logits(logits, sampler.batch_info(reqs, logits.device))


def support(row: torch.Tensor) -> set[int]:
    return set(row.nonzero().flatten().tolist())


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Brute force: the smallest set of best tokens whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += float(probs[token])
        if mass >= top_p:
            break
    return kept


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    logits[3, [10, 20]] = 50.0  # tie: the first index wins, like torch.argmax
    reqs = [make_req(temperature=0.0) for _ in range(4)] + [make_req(top_k=1) for _ in range(4)]
    out = sample(1000, logits, reqs)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids[3] == 10
    assert out.next_token_ids.dtype == torch.int64
    assert out.top_logprobs() is None
    half = logits.bfloat16()
    assert torch.equal(sample(1000, half, reqs).next_token_ids, half.float().argmax(-1))


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 500) * 3
    reqs = [make_req(temperature=0.0, repetition_penalty=1.5, output=(4, 4)),
            make_req(temperature=0.5, top_p=0.8),
            make_req(temperature=1.3, top_k=10, frequency_penalty=0.7, output=(1, 2)),
            make_req(min_p=0.1, min_new_tokens=3)]
    out = sample(500, logits, reqs)
    expected = torch.log_softmax(logits, -1).gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert out.next_token_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.next_token_logprobs, expected, atol=1e-5, rtol=0)


def test_logprobs_are_skipped_when_nobody_asks() -> None:
    logits = torch.randn(3, 200)
    reqs = [make_req(return_logprob=False, temperature=0.0) for _ in range(3)]
    out = sample(200, logits, reqs)
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.top_logprobs() is None and out.next_token_logprobs is None
    assert out.logprobs() is None


def test_logprobs_only_for_rows_that_ask() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, 300) * 2
    reqs = [make_req(return_logprob=False, temperature=0.0),
            make_req(temperature=0.0, top_logprobs_num=3),
            make_req(return_logprob=False, temperature=0.0),
            make_req(temperature=0.0)]
    out = sample(300, logits, reqs)
    assert out.next_token_logprobs.shape == (2,)  # rows 1 and 3 only
    assert out.top_logprob_values.shape == (2, 3)
    reference = torch.log_softmax(logits, -1)
    logprobs = out.logprobs()
    assert logprobs is not None and logprobs[0] == logprobs[2] == 0.0
    for row in (1, 3):
        assert logprobs[row] == pytest.approx(float(reference[row, logits[row].argmax()]),
                                              abs=1e-5)
    tops = out.top_logprobs()
    assert tops is not None and tops[0] == tops[2] == tops[3] == []
    assert [t for _, t in tops[1]] == reference[1].topk(3).indices.tolist()


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_token_ids_logprobs_of_the_rows_that_name_ids(kernel: bool, monkeypatch) -> None:
    """Rows naming ids get those ids' raw logprobs in their order (duplicates kept), packed
    after the top logprobs of the widest row: neither those nor the sampled logprobs move; rows
    naming none (asking for logprobs or not) get None."""
    if kernel:  # the Triton kernel's packing (in its interpreter) before the appended columns
        monkeypatch.setattr("lmnb.runtime.sampling.sampler.KERNEL_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(7)
    logits = torch.randn(5, 300) * 2
    asked = [[299, 0, 17], None, [5], None, [17, 17]]
    reqs = [make_req(temperature=0.0, token_ids_logprob=asked[0], top_logprobs_num=2),
            make_req(return_logprob=False, temperature=0.0),
            make_req(return_logprob=False, temperature=0.0, token_ids_logprob=asked[2]),
            make_req(temperature=0.0, top_logprobs_num=4),
            make_req(temperature=0.0, token_ids_logprob=asked[4])]
    out = sample(300, logits, reqs)
    reference = torch.log_softmax(logits, -1)
    rows = out.token_ids_logprobs()
    assert rows is not None and rows[1] is None and rows[3] is None
    for row in (0, 2, 4):
        assert [t for _, t in rows[row]] == asked[row]
        torch.testing.assert_close(torch.tensor([v for v, _ in rows[row]]),
                                   reference[row, asked[row]], atol=1e-5, rtol=0)
    tops = out.top_logprobs()
    assert tops is not None
    for row, n in ((0, 2), (3, 4)):
        assert [t for _, t in tops[row]] == reference[row].topk(n).indices.tolist()
    logprobs = out.logprobs()
    assert logprobs is not None and logprobs[1] == 0.0
    for row in (0, 2, 3, 4):
        assert logprobs[row] == pytest.approx(float(reference[row].max()), abs=1e-5)
    plain = sample(300, logits[:2], [make_req(temperature=0.0, top_logprobs_num=2)] * 2)
    assert plain.token_ids_logprobs() is None


def test_top_logprobs_sorted_with_requested_length() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    wanted = [0, 1, 5, 20]
    reqs = [make_req(temperature=0.0, top_logprobs_num=n) for n in wanted]
    out = sample(300, logits, reqs)
    tops_per_row = out.top_logprobs()
    assert tops_per_row is not None
    reference = torch.log_softmax(logits, -1)
    for row, n, tops in zip(range(4), wanted, tops_per_row, strict=True):
        assert len(tops) == n
        values = [v for v, _ in tops]
        assert values == sorted(values, reverse=True)
        best = reference[row].topk(n) if n else None
        if best is not None:
            assert [t for _, t in tops] == best.indices.tolist()
            torch.testing.assert_close(torch.tensor(values), best.values, atol=1e-5, rtol=0)
    assert tops_per_row[1][0][1] == int(out.next_token_ids[1])


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_frequencies_follow_softmax(temperature: float) -> None:
    torch.manual_seed(3)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    draws = 20000
    reqs = [make_req(temperature=temperature) for _ in range(draws)]
    ids = sample(8, base.expand(draws, 8).clone(), reqs).next_token_ids
    observed = torch.bincount(ids, minlength=8).double()
    expected = torch.softmax(base.double() / temperature, -1) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


@pytest.mark.parametrize("params", [dict(top_k=4, temperature=0.8), dict(top_p=0.7),
                                    dict(top_k=6, top_p=0.8, min_p=0.2, temperature=1.3)])
def test_cut_frequencies_follow_renormalised_distribution(params: dict[str, float]) -> None:
    torch.manual_seed(13)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    draws = 20000
    reqs = [make_req(**params) for _ in range(draws)]
    target = distribution(8, base[None], reqs[:1])[0].double()
    assert 1 < int((target > 0).sum()) < 8
    ids = sample(8, base.expand(draws, 8).clone(), reqs).next_token_ids
    observed = torch.bincount(ids, minlength=8).double()
    assert observed[target == 0].sum() == 0
    kept = target > 0
    expected = target[kept] * draws
    chi2 = float(((observed[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # at most 5 degrees of freedom, p = 0.001


def test_top_k_restricts_support() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, 2000)
    ks = [1, 2, 7, 50, 1999]
    reqs = [make_req(temperature=0.9, top_k=k) for k in ks]
    probs = distribution(2000, logits, reqs)
    for row, k in enumerate(ks):
        assert support(probs[row]) == set(logits[row].topk(k).indices.tolist())
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    small = torch.randn(1, 20).expand(2000, 20).clone()
    ids = sample(20, small, [make_req(top_k=3) for _ in range(2000)]).next_token_ids
    assert set(ids.tolist()) == set(small[0].topk(3).indices.tolist())


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_top_p_support_is_minimal_nucleus(scale: float) -> None:
    torch.manual_seed(5)
    vocab = 3000
    logits = torch.randn(12, vocab) * scale  # scale 0.05: nucleus far wider than first window
    top_ps = [0.05, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0, 0.6]
    temps = [1.0, 0.5, 1.5] * 4
    reqs = [make_req(temperature=t, top_p=p) for t, p in zip(temps, top_ps, strict=True)]
    probs = distribution(vocab, logits, reqs)
    for row, (t, p) in enumerate(zip(temps, top_ps, strict=True)):
        full = torch.softmax(logits[row] / t, -1)
        expected = set(range(vocab)) if p == 1.0 else nucleus(full, p)
        assert support(probs[row]) == expected
        kept = sorted(expected)
        torch.testing.assert_close(probs[row, kept], full[kept] / full[kept].sum())


def test_top_p_keeps_best_token() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]])
    probs = distribution(4, logits, [make_req(top_p=0.01)])
    assert support(probs[0]) == {0}


def test_min_p_support() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 1000) * 2
    min_ps = [0.0, 0.05, 0.3, 1.0]
    reqs = [make_req(temperature=0.8, min_p=m) for m in min_ps]
    probs = distribution(1000, logits, reqs)
    for row, m in enumerate(min_ps):
        full = torch.softmax(logits[row] / 0.8, -1)
        assert support(probs[row]) == set((full >= m * full.max()).nonzero().flatten().tolist())


def test_filter_chain_matches_hf_warpers() -> None:
    torch.manual_seed(7)
    vocab = 4000
    logits = torch.randn(6, vocab) * 2
    settings = [(0.7, 40, 0.9, 0.0), (1.2, 200, 0.5, 0.05), (1.0, 5, 0.99, 0.0),
                (0.5, -1, 0.8, 0.1), (2.0, 1000, 0.95, 0.02), (1.0, 3, 1.0, 0.2)]
    reqs = [make_req(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    probs = distribution(vocab, logits, reqs)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for row, (t, k, p, m) in enumerate(settings):
        scores = TemperatureLogitsWarper(t)(ids, logits[row : row + 1].clone())
        if k > 0:
            scores = TopKLogitsWarper(k)(ids, scores)
        if p < 1.0:
            scores = TopPLogitsWarper(p)(ids, scores)
        if m > 0:
            scores = MinPLogitsWarper(m)(ids, scores)
        expected = torch.softmax(scores, -1)[0]
        assert support(probs[row]) == support(expected)
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=1e-5)


def test_repetition_penalty_matches_hf() -> None:
    torch.manual_seed(8)
    vocab = 100
    logits = torch.randn(3, vocab) * 3
    prompt, output = (5, 6, 7, 7, 99), (6, 11, 12, 12)
    penalties = [1.3, 0.7, 1.0]
    reqs = [make_req(prompt=prompt, output=output, temperature=0.0, repetition_penalty=r)
            for r in penalties]
    adjusted = adjusted_logits(vocab, logits, reqs)
    history = torch.tensor([prompt + output])
    for row, r in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(r)(history, logits[row : row + 1].clone())
        assert torch.equal(adjusted[row], expected[0])
    out = sample(vocab, logits, reqs)
    assert torch.equal(out.next_token_ids, adjusted.argmax(-1))


def test_frequency_and_presence_penalties_hand_computed() -> None:
    torch.manual_seed(9)
    vocab = 50
    logits = torch.randn(3, vocab)
    prompt, output = (1, 2, 3, 30), (3, 4, 4, 4, 9, 3)
    params = [dict(frequency_penalty=0.5), dict(presence_penalty=-0.8),
              dict(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=1.1)]
    reqs = [make_req(prompt=prompt, output=output, **p) for p in params]
    adjusted = adjusted_logits(vocab, logits, reqs)
    for row, p in enumerate(params):
        expected = logits[row].clone()
        rep = p.get("repetition_penalty", 1.0)
        for token in set(prompt + output):
            value = float(expected[token])
            expected[token] = value * rep if value < 0 else value / rep
        for token in set(output):
            expected[token] -= p.get("frequency_penalty", 0.0) * output.count(token)
            expected[token] -= p.get("presence_penalty", 0.0)
        torch.testing.assert_close(adjusted[row], expected, atol=1e-6, rtol=0)
    untouched = adjusted_logits(vocab, logits, [make_req() for _ in range(3)])
    assert torch.equal(untouched, logits)


def test_min_new_tokens_blocks_eos_and_stop_ids() -> None:
    vocab = 10
    logits = torch.zeros(4, vocab)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    logits[:, 7] = 8.0
    blocked = [make_req(temperature=0.0, min_new_tokens=3, stop_token_ids=[5], output=(1, 2)),
               make_req(min_new_tokens=2, stop_token_ids=[5], ignore_eos=True)]
    done = [make_req(temperature=0.0, min_new_tokens=2, stop_token_ids=[5], output=(1, 2)),
            make_req(temperature=0.0, min_new_tokens=3)]
    out = sample(vocab, logits, blocked + done)
    assert out.next_token_ids[0] == 7 and out.next_token_ids[2] == EOS
    assert out.next_token_ids[3] == 5  # EOS blocked, stop id 5 is not this request's
    probs = distribution(vocab, logits[:2], blocked)
    assert probs[:, EOS].eq(0).all() and probs[:, 5].eq(0).all()
    many = sample(vocab, logits[1:2].expand(3000, vocab).clone(),
                   [make_req(min_new_tokens=1, stop_token_ids=[5]) for _ in range(3000)])
    assert not set(many.next_token_ids.tolist()) & {EOS, 5}


@pytest.mark.parametrize("params", [dict(temperature=1.1, top_p=0.95, top_k=500),
                                    dict(temperature=0.9), dict(top_p=0.9, min_p=0.01)])
def test_seeded_requests_are_batch_independent(params: dict[str, float]) -> None:
    torch.manual_seed(10)
    vocab = 5000
    row = torch.randn(vocab) * 2

    def run(batch_size: int, position: int, steps: int = 6) -> list[int]:
        seeded = make_req(seed=1234, **params)
        tokens = []
        for _ in range(steps):
            logits = torch.randn(batch_size, vocab) * 4
            logits[position] = row
            reqs = [make_req(temperature=float(t % 3), top_p=0.5 + 0.1 * (t % 5))
                    for t in range(batch_size)]
            reqs[position] = seeded
            tokens.append(int(sample(vocab, logits, reqs).next_token_ids[position]))
        return tokens

    first = run(1, 0)
    assert run(7, 3) == first
    assert run(32, 31) == first
    assert len(set(first)) > 1
    other = make_req(seed=99, **params)
    assert [int(sample(vocab, row[None], [other]).next_token_ids[0])
            for _ in range(6)] != first


def test_vocab_mask_and_padded_logits() -> None:
    torch.manual_seed(11)
    logits = torch.randn(4, 128)
    logits[:, 100:] = 100.0  # padding past the tokenizer's vocab is never sampled
    mask = torch.zeros(4, 128, dtype=torch.bool)
    mask[:, [3, 8, 9]] = True
    reqs = [make_req(temperature=0.0), make_req(), make_req(top_p=0.5), make_req(top_k=50)]
    out = sample(100, logits, reqs)
    assert (out.next_token_ids < 100).all()
    masked = sample(100, logits, reqs, vocab_mask=mask)
    assert set(masked.next_token_ids.tolist()) <= {3, 8, 9}
    assert int(masked.next_token_ids[0]) == [3, 8, 9][int(logits[0, [3, 8, 9]].argmax())]
    expected = torch.log_softmax(logits[:, :100], -1).gather(1, masked.next_token_ids[:, None])
    torch.testing.assert_close(masked.next_token_logprobs, expected.squeeze(1))


def test_everything_masked_or_nan_raises() -> None:
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(RuntimeError, match="every token is masked"):
        sample(10, torch.randn(2, 10), [make_req(), make_req()], vocab_mask=mask)
    only_eos = torch.full((1, 10), float("-inf"))
    only_eos[0, EOS] = 1.0
    with pytest.raises(RuntimeError, match="every token is masked"):
        sample(10, only_eos, [make_req(min_new_tokens=1)])
    nan = torch.randn(2, 10)
    nan[0, 4] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        sample(10, nan, [make_req(temperature=0.0), make_req()])


def test_mixed_large_batch_runs() -> None:
    torch.manual_seed(12)
    vocab, bs = 32000, 64
    logits = torch.randn(bs, vocab, dtype=torch.bfloat16) * 3
    reqs = []
    for i in range(bs):
        reqs.append(make_req(
            prompt=tuple(range(i, i + 50)), output=tuple(range(i % 7)),
            temperature=[0.0, 0.7, 1.0][i % 3], top_p=[1.0, 0.9][i % 2],
            top_k=[-1, 20, -1, 100][i % 4], min_p=[0.0, 0.05][i % 5 == 0],
            repetition_penalty=[1.0, 1.1][i % 6 == 0], frequency_penalty=[0.0, 0.2][i % 4 == 1],
            seed=i if i % 8 == 0 else None, top_logprobs_num=i % 3))
    out = sample(vocab, logits, reqs)
    assert out.next_token_ids.shape == (bs,)
    assert ((out.next_token_ids >= 0) & (out.next_token_ids < vocab)).all()
    assert torch.isfinite(out.next_token_logprobs).all()
    tops = out.top_logprobs()
    assert tops is not None
    assert [len(t) for t in tops] == [i % 3 for i in range(bs)]


def test_top_k_matches_torch_topk() -> None:
    from lmnb.runtime.sampling.sampler import top_k

    torch.manual_seed(13)
    for rows, width, k in [(1, 128 * 40, 5), (3, 128 * 64, 20), (2, 1000, 5), (2, 128 * 8, 5)]:
        values = torch.randn(rows, width)
        values[0, 7] = 9.0  # several of the best in one block
        values[0, 9] = 8.0
        top, ids = top_k(values, k)
        expected = values.topk(k, dim=-1)
        assert torch.equal(top, expected.values) and torch.equal(ids, expected.indices)
