"""SamplingBatchInfo: reuse across steps (`matches`) and state advanced on the device (penalty
counts, min_new_tokens) equal to an info rebuilt from the rows at every step."""

import torch

from lmnb.runtime.core import Req, SamplingParams
from lmnb.runtime.sampling import Sampler, SamplingBatchInfo
from lmnb.runtime.scheduler import ReqState

EOS = 0
VOCAB = 40


def make_req(prompt: tuple[int, ...] = (1, 2, 3), output: tuple[int, ...] = (),
             return_logprob: bool = False, top_logprobs_num: int = 0, **params: object) -> ReqState:
    req = Req(origin_input_ids=list(prompt), sampling_params=SamplingParams(**params),
              return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
    req.output_ids = list(output)
    return ReqState(req)


def build(reqs: list[Req]) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(reqs, "cpu", VOCAB, {EOS})


def test_matches_while_rows_grow_by_the_advanced_tokens() -> None:
    reqs = [make_req(), make_req(output=(4, 5)), make_req(temperature=0.0)]
    info = build(reqs)
    assert info.matches(reqs)
    assert not info.matches(reqs[:2])
    assert not info.matches([reqs[1], reqs[0], reqs[2]])
    info.advance(torch.tensor([7, 8, 9]))
    assert info.matches(reqs)  # one step behind: the overlap schedule's pass in flight
    info.advance(torch.tensor([1, 2, 3]))
    assert not info.matches(reqs)  # two steps behind: tokens were lost
    for req, first, second in zip(reqs, (7, 8, 9), (1, 2, 3), strict=True):
        req.output_ids.extend((first, second))
    assert info.matches(reqs)
    reqs[1].output_ids.append(10)  # a token the info never saw (e.g. jump-forward)
    assert not info.matches(reqs)
    reqs[1].output_ids.pop()
    reqs[2].req.output_ids = list(reqs[2].output_ids)  # jump-forward replaces the list
    assert not info.matches(reqs)


def test_groups_and_flags() -> None:
    reqs = [make_req(temperature=0.0), make_req(top_k=1), make_req(temperature=0.7),
            make_req(top_p=0.9), make_req(top_k=5)]
    info = build(reqs)
    assert not info.all_greedy
    assert info.full is not None and info.full.rows.tolist() == [2]
    assert info.cut is not None and info.cut.rows.tolist() == [3, 4]
    assert info.penalties is None and info.min_new_tokens is None and not info.need_logprobs
    greedy = build([make_req(temperature=0.0, top_logprobs_num=3)])
    assert greedy.all_greedy and greedy.full is None and greedy.cut is None
    assert greedy.need_logprobs and greedy.max_top_logprobs == 3


def test_advanced_state_equals_a_rebuild_every_step() -> None:
    torch.manual_seed(0)
    reqs = [make_req(prompt=(1, 2, 2, 30), output=(3,), frequency_penalty=0.7,
                     presence_penalty=-0.4, min_new_tokens=4, stop_token_ids=[5]),
            make_req(repetition_penalty=1.6, temperature=0.0),
            make_req(temperature=0.8, top_k=6, repetition_penalty=0.8, frequency_penalty=1.0),
            make_req(top_p=0.8, min_new_tokens=2),
            make_req(temperature=0.0)]
    for req in reqs:
        req.generator = torch.Generator().manual_seed(len(req.output_ids) + 3)
    sampler = Sampler(VOCAB, {EOS})
    kept = sampler.batch_info(reqs, "cpu")
    for step in range(12):
        logits = torch.randn(len(reqs), VOCAB) * 2
        logits[:, [EOS, 5]] += 4.0  # stop ids are likely once they are allowed
        assert kept.matches(reqs)
        fresh = sampler.batch_info(reqs, "cpu")
        assert torch.equal(sampler.adjusted_logits(logits, kept),
                           sampler.adjusted_logits(logits, fresh)), step
        out = sampler(logits, kept)
        kept.advance(out.next_token_ids)
        for req, token in zip(reqs, out.token_ids(), strict=True):
            assert token != EOS or len(req.output_ids) >= req.sampling_params.min_new_tokens
            req.output_ids.append(token)
    assert kept.penalties is not None and kept.penalties.counts is not None
    # Counts of the frequency rows are the output histograms.
    assert kept.penalties.fp_rows is not None
    assert kept.penalties.fp_rows.tolist() == [0, 2]
    for local, i in enumerate(kept.penalties.fp_rows.tolist()):
        histogram = torch.bincount(torch.tensor(reqs[i].output_ids), minlength=VOCAB)
        assert torch.equal(kept.penalties.counts[local], histogram.float())


def test_sample_output_host_copy_and_sync() -> None:
    reqs = [make_req(temperature=0.0, top_logprobs_num=2), make_req(temperature=0.0)]
    sampler = Sampler(VOCAB, {EOS})
    logits = torch.randn(2, VOCAB)
    out = sampler(logits, sampler.batch_info(reqs, "cpu"))
    assert out.token_ids() == logits.argmax(-1).tolist()
    assert torch.equal(out.next_token_ids_cpu, out.next_token_ids)
    tops = out.top_logprobs()
    assert tops is not None and [len(t) for t in tops] == [2, 0]
    assert tops[0][0][1] == out.token_ids()[0]


def test_runtime_reuses_the_info_and_matches_hf_repetition_penalty(tiny_models,
                                                                   monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    from lmnb.runtime.engine import Runtime

    builds: list[int] = []
    real = Sampler.batch_info

    def counting(self: Sampler, rows: list, device: torch.device) -> SamplingBatchInfo:
        builds.append(len(rows))
        return real(self, rows, device)

    monkeypatch.setattr(Sampler, "batch_info", counting)
    folder = tiny_models["llama-gqa"]
    prompts = [[5, 17, 300, 17, 42], [9, 9, 9, 1000, 77, 3, 8], [400, 401]]
    new_tokens = 12
    runtime = Runtime(folder, max_total_tokens=2048)
    try:
        outs = runtime.generate(input_ids=prompts, sampling_params={
            "temperature": 0.0, "repetition_penalty": 1.5, "ignore_eos": True,
            "max_new_tokens": new_tokens})
    finally:
        runtime.close()
    assert len(builds) <= 4, builds  # one per batch composition, not one per step
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, repetition_penalty=1.5, pad_token_id=0)
        assert out["output_ids"] == expected[0, len(ids):].tolist()


def test_rows_are_named_by_their_request_id_in_errors() -> None:
    """A failed draw names the request (`ReqState.rid`); a row of no request by its index."""
    reqs = [make_req(temperature=0.0), make_req(temperature=0.0)]
    sampler = Sampler(VOCAB, eos_token_ids=[EOS])
    logits = torch.randn(2, VOCAB)
    logits[1] = float("-inf")
    out = sampler(logits, sampler.batch_info(reqs, "cpu"))
    failed = out.wait()
    assert list(failed) == [1] and failed[1].startswith(f"request {reqs[1].rid}: ")
    draft = SamplingBatchInfo.build([_NamelessRow()], "cpu", VOCAB, {EOS})
    assert draft.label(0) == "row 0"


class _NamelessRow:
    """A row that is no request's (the draft model's, the memory profile's)."""

    rid = None
    sampling_params = SamplingParams(temperature=0.0)
    origin_input_ids = [1]
    output_ids: list[int] = []
    generator = None
    grammar = None
    return_logprob = False
    top_logprobs_num = 0
    token_ids_logprob = None
