"""`logit_bias` (SGLang's and OpenAI's): {token id: bias} added to a request's logits before
sampling. The sampler (torch path on the CPU, and the Triton kernels' path in their interpreter):
biased rows' logits move by exactly the bias after the penalties, other rows are untouched and a
batch without a bias makes no copy; greedy and sampled rows follow the bias; grammar masks and
min_new_tokens blocks hold over it; logprobs stay those of the raw distribution. The runtime API
on the tiny model: forced and banned tokens, batched beside requests without a bias, constrained
output, the vocabulary check, the overlap schedule."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.triton_modes import DEVICES, SAME_TRITON_MODE

# isort: split
from lmnb.params import InvalidRequestError
from lmnb.runtime.engine import Runtime
from lmnb.runtime.sampling import Sampler, pack_mask, sampler
from lmnb.runtime.scheduler import ReqState
from tests.test_sampling import make_req

EOS = 0
# (device, whether the kernel path runs): torch ops on the CPU, and the Triton kernels (greedy
# rows, the race, the logprob packing) in their interpreter on the CPU or compiled on CUDA.
PATHS = [pytest.param(("cpu", False), id="torch")] + [
    pytest.param((p.values[0], True), marks=[*p.marks, SAME_TRITON_MODE],
                 id=f"kernel-{p.values[0]}") for p in DEVICES]


@pytest.fixture
def path(request, monkeypatch) -> str:
    device, kernel = request.param
    monkeypatch.setattr(sampler, "KERNEL_DEVICES", (device,) if kernel else ())
    return device


def run(vocab: int, logits: torch.Tensor, rows: list[ReqState], device: str,
        mask: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    sampling = Sampler(vocab, {EOS})
    bitmask = None if mask is None else pack_mask(mask).to(device)
    out = sampling(logits.to(device), sampling.batch_info(rows, device), bitmask)
    out.synchronize()
    logprobs = out.logprobs()
    assert logprobs is not None
    return out.next_token_ids.cpu().tolist(), logprobs


# ---- the sampler -------------------------------------------------------------------------------
def test_biased_rows_move_by_the_bias_after_the_penalties_and_others_not() -> None:
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 9] = -2.0
    bias = {9: 5.0, 63: -100.0, 0: 0.25}
    rows = [make_req(logit_bias=bias, repetition_penalty=2.0, output=(9,)), make_req(),
            make_req(logit_bias={"4": -1.5}, temperature=0.5)]
    sampling = Sampler(vocab, {EOS})
    info = sampling.batch_info(rows, "cpu")
    adjusted = sampling.adjusted_logits(logits, info)
    expected = logits.clone()
    for token in (1, 2, 3):  # the prompt's
        value = float(logits[0, token])
        expected[0, token] = value * 2.0 if value < 0 else value / 2.0
    expected[0, 9] = -2.0 * 2.0 + 5.0  # the repetition penalty first, then the bias (SGLang)
    expected[0, 63] -= 100.0
    expected[0, 0] += 0.25
    expected[2, 4] -= 1.5
    torch.testing.assert_close(adjusted, expected, atol=1e-6, rtol=0)
    assert torch.equal(adjusted[1], logits[1])
    plain = sampling.batch_info([make_req(), make_req()], "cpu")
    assert plain.logit_bias is None and not plain.adjusts_logits
    assert sampling.adjusted_logits(logits[:2], plain).data_ptr() == logits.data_ptr()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_greedy_and_sampled_rows_follow_the_bias(path: str) -> None:
    """Greedy, full (temperature), min-p and cut (top-k / top-p) rows, seeded or not: +100 on a
    token makes it the draw, -100 on the row's best token bans it; the rows without a bias draw
    what they draw in a batch where nobody has one."""
    vocab = 3000
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 2
    best = logits.argmax(-1).tolist()
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, min_p=0.05),
             dict(top_k=20), dict(top_p=0.9, seed=7)]

    def rows(biases: dict[int, dict[int, float]]) -> list[ReqState]:
        return [make_req(logit_bias=biases.get(i), **kinds[i % len(kinds)]) for i in range(8)]

    forced = {i: {1234 + i: 100.0} for i in (0, 1, 2, 3, 4)}
    ids, _ = run(vocab, logits, rows(forced), path)
    assert ids[:5] == [1234, 1235, 1236, 1237, 1238]
    banned = {i: {best[i]: -100.0} for i in (0, 1, 2, 3, 4)}
    ids, _ = run(vocab, logits, rows(banned), path)
    assert all(ids[i] != best[i] for i in range(5))
    greedy_ban, _ = run(vocab, logits[:1], [make_req(temperature=0.0,
                                                      logit_bias={best[0]: -100.0})], path)
    second = logits[0].clone()
    second[best[0]] = float("-inf")
    assert greedy_ban == [int(second.argmax())]
    torch.manual_seed(3)
    alone, _ = run(vocab, logits[5:], [make_req(temperature=0.0), make_req(temperature=1.0, seed=3),
                                       make_req(top_k=5, seed=4)], path)
    with_bias = [make_req(logit_bias={1: 50.0}, temperature=0.0) for _ in range(5)]
    torch.manual_seed(3)
    beside, _ = run(vocab, logits, with_bias + [make_req(temperature=0.0),
                                                make_req(temperature=1.0, seed=3),
                                                make_req(top_k=5, seed=4)], path)
    assert beside[:5] == [1] * 5 and beside[5:] == alone


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_logprobs_are_of_the_raw_distribution(path: str) -> None:
    vocab = 500
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    rows = [make_req(temperature=0.0, logit_bias={17: 100.0}),
            make_req(temperature=1.0, seed=1, logit_bias={"23": 100.0})]
    ids, logprobs = run(vocab, logits, rows, path)
    assert ids == [17, 23]
    raw = torch.log_softmax(logits, -1)
    assert logprobs == pytest.approx([float(raw[0, 17]), float(raw[1, 23])], abs=1e-5)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_grammar_masks_and_min_new_tokens_hold_over_the_bias(path: str) -> None:
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(4, vocab, dtype=torch.bool)
    mask[:, [5, 6, 7]] = True
    biased = {9: 100.0, 6: 30.0}  # 9 is masked out: the draw stays in {5, 6, 7}, and is 6
    rows = [make_req(temperature=0.0, logit_bias=biased), make_req(logit_bias=biased, seed=2),
            make_req(temperature=0.0, logit_bias={9: 100.0}), make_req(logit_bias={9: 100.0})]
    ids, _ = run(vocab, logits, rows, path, mask)
    assert ids[:2] == [6, 6]
    assert ids[2] == [5, 6, 7][int(logits[2, [5, 6, 7]].argmax())] and ids[3] in (5, 6, 7)
    blocked = [make_req(temperature=0.0, min_new_tokens=2, logit_bias={EOS: 100.0}),
               make_req(temperature=0.0, min_new_tokens=2, logit_bias={EOS: 100.0},
                        output=(4, 4))]
    ids, _ = run(vocab, logits[:2], blocked, path)
    assert ids[0] != EOS and ids[1] == EOS


# ---- the runtime -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=4096,
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


PROMPT = "The colour of the sky is"
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def test_runtime_forces_and_bans_tokens(rt) -> None:
    token = rt.tokenizer.encode(" blue", add_special_tokens=False)[0]
    forced = rt.generate(PROMPT, {**GREEDY, "logit_bias": {str(token): 100.0}})
    assert forced["output_ids"] == [token] * 6
    sampled = rt.generate(PROMPT, {**GREEDY, "temperature": 1.0, "logit_bias": {token: 100}})
    assert sampled["output_ids"] == [token] * 6
    plain = rt.generate(PROMPT, GREEDY)["output_ids"]
    first = plain[0]
    banned = rt.generate(PROMPT, {**GREEDY, "logit_bias": {first: -100.0}})["output_ids"]
    assert first not in banned and banned != plain
    assert rt.generate(PROMPT, GREEDY)["output_ids"] == plain


def test_requests_without_a_bias_are_unchanged_beside_biased_ones(rt) -> None:
    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 4,", "def main():"]
    alone = [rt.generate(p, GREEDY)["output_ids"] for p in prompts]
    token = rt.tokenizer.encode(" blue", add_special_tokens=False)[0]
    params = [GREEDY, {**GREEDY, "logit_bias": {token: 100.0}}, GREEDY,
              {**GREEDY, "logit_bias": {alone[3][0]: -100.0}}]
    together = [o["output_ids"] for o in rt.generate(prompts, params)]
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[1] == [token] * 6 and alone[3][0] not in together[3]


def test_constrained_output_holds_over_the_bias(rt) -> None:
    letters = rt.tokenizer.encode(" blue", add_special_tokens=False)[0]
    seven = rt.tokenizer.encode("7", add_special_tokens=False)[0]
    out = rt.generate(PROMPT, {**GREEDY, "regex": "[0-9]{4}",
                               "logit_bias": {letters: 100.0, seven: 50.0}})
    assert out["text"] == "7777"


def test_the_forced_tokens_logprob_is_its_raw_one(rt) -> None:
    token = rt.tokenizer.encode(" blue", add_special_tokens=False)[0]
    params = {**GREEDY, "max_new_tokens": 1}
    raw = rt.generate(PROMPT, params, return_logprob=True, token_ids_logprob=[token])
    ((raw_logprob, _),) = raw["meta_info"]["output_token_ids_logprobs"][0]
    forced = rt.generate(PROMPT, {**params, "logit_bias": {token: 100.0}}, return_logprob=True)
    ((logprob, got, *_),) = forced["meta_info"]["output_token_logprobs"]
    assert got == token and logprob == pytest.approx(raw_logprob, abs=1e-4) and logprob < -1.0


def test_ids_outside_the_vocabulary_are_refused_naming_logit_bias(rt) -> None:
    vocab = rt.model_config.vocab_size
    last = rt.generate(PROMPT, {**GREEDY, "logit_bias": {vocab - 1: 100.0}})
    assert last["output_ids"] == [vocab - 1] * 6
    for bad in ({vocab: 1.0}, {"-1": 1.0}):
        with pytest.raises(InvalidRequestError, match=r"logit_bias: token id\(s\) \[-?\d+\] not "
                           rf"in the vocabulary \[0, {vocab}\)") as raised:
            rt.generate(PROMPT, {**GREEDY, "logit_bias": bad})
        assert raised.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError, match="logit_bias values must be finite"):
        rt.generate(PROMPT, {**GREEDY, "logit_bias": {"5": float("inf")}})
    assert rt.generate(PROMPT, GREEDY)["output_ids"]


def test_overlap_schedule_keeps_each_bias_on_its_own_request(rt, tiny_models) -> None:
    """With the overlap schedule (a pass launched before the previous one is read; requests
    that end in flight leave the next pass's rows), each request's bias stays on its own row:
    outputs equal the plain schedule's."""
    blue = rt.tokenizer.encode(" blue", add_special_tokens=False)[0]
    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 4,", "def main():"]
    plain = [rt.generate(p, GREEDY)["output_ids"] for p in prompts]
    params = [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "logit_bias": {plain[1][1]: -100.0}},
              {**GREEDY, "max_new_tokens": 3, "logit_bias": {blue: 100.0}},
              {**GREEDY, "logit_bias": {plain[3][0]: -100.0, blue: 3.0}}]
    want = [o["output_ids"] for o in rt.generate(prompts, params)]
    with Runtime(tiny_models["llama-gqa"], max_total_tokens=4096, disable_overlap_schedule=False,
                 check_integrity_each_step=True) as overlapped:
        got = [o["output_ids"] for o in overlapped.generate(prompts, params)]
        assert overlapped.stats()["overlapped_passes"] > 0
    assert got == want and want[2] == [blue] * 3 and plain[1][1] not in want[1]
