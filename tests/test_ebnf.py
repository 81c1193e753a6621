"""EBNF grammars (SGLang's `ebnf` sampling parameter) and `grammar_backend="xgrammar"`: every
output is in its grammar's language (checked by parsers written here, not by xgrammar), from the
runtime, the DSL, `/generate` and the OpenAI routes; regex and JSON schema through xgrammar
fullmatch / validate; xgrammar's masks agree with lmnb's FSM on the same regex; a bad grammar is a
clear 400 and the runtime stays usable. One runtime (tiny random-weight Llama, SmolLM2's tokenizer)
serves the module."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import httpx
import jsonschema
import openai
import pytest
import torch

import lmnb
from lmnb.params import InvalidRequestError, SamplingParams
from lmnb.runtime.config import EngineConfig
from lmnb.runtime.engine import Runtime
from lmnb.runtime.fsm.factory import GrammarFactory
from lmnb.runtime.fsm.grammar import RequestGrammar
from lmnb.runtime.fsm.json_schema import json_schema_to_regex
from lmnb.runtime.fsm.xgrammar_backend import XGrammarMatcher
from lmnb.runtime.sampling.bitmask import unpack_bitmask
from lmnb.server import ServerHandle

PROMPT = "Answer:"
YES_NO = 'root ::= "yes" | "no"'
# Nested rules and alternatives; finite, so that every sampled output ends within the budget.
ARITHMETIC = r"""
root ::= term | term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [0-9] | [1-9] [0-9]
"""
JSONISH = r"""
root ::= "{" pair (", " pair)? "}"
pair ::= key ": " value
key ::= "\"" [a-z] [a-z]? [a-z]? "\""
value ::= "true" | "false" | "null" | [0-9] [0-9]? | key
"""
FORCED = r'root ::= "The answer is: " ("yes" | "no") "."'
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
REGEX = r"[0-9]{3}-[a-z]{1,4}(!|\?)"


# ---------------------------------------------------------------- membership, written here

def is_yes_no(text: str) -> bool:
    return text in ("yes", "no")


def is_arithmetic(text: str) -> bool:
    num = r"(?:[0-9]|[1-9][0-9])"
    term = rf"(?:{num}|\({num}[-+*]{num}\))"
    return re.fullmatch(rf"{term}(?:[-+*]{term})?", text) is not None


def is_jsonish(text: str) -> bool:
    key = r'"[a-z]{1,3}"'
    value = rf"(?:true|false|null|[0-9]{{1,2}}|{key})"
    pair = rf"{key}: {value}"
    if re.fullmatch(rf"\{{{pair}(?:, {pair})?\}}", text) is None:
        return False
    return isinstance(json.loads(text), dict)  # and it is JSON indeed


def is_forced(text: str) -> bool:
    return text in ("The answer is: yes.", "The answer is: no.")


GRAMMARS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "yes_no": (YES_NO, is_yes_no), "arithmetic": (ARITHMETIC, is_arithmetic),
    "jsonish": (JSONISH, is_jsonish), "forced": (FORCED, is_forced)}


def test_membership_checkers_tell_apart():
    assert is_arithmetic("(3+41)*7") and not is_arithmetic("(3+41") and not is_arithmetic("05")
    assert is_jsonish('{"ab": 12, "c": "xy"}') and not is_jsonish('{"ab": 123}')
    assert is_yes_no("no") and not is_yes_no("nope")


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def rt(tiny_models) -> Iterator[Runtime]:
    runtime = Runtime(tiny_models["llama-gqa"], max_total_tokens=4096, grammar_backend="xgrammar",
                      check_integrity_each_step=True)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def server(rt) -> Iterator[ServerHandle]:
    with ServerHandle.start(rt, served_model_name="tiny") as handle:
        yield handle


# ---------------------------------------------------------------- runtime

@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_ebnf_outputs_are_in_the_language(rt, name):
    grammar, member = GRAMMARS[name]
    greedy = {"ebnf": grammar, "temperature": 0.0, "max_new_tokens": 40}
    sampled = {"ebnf": grammar, "temperature": 1.0, "seed": 7, "n": 4, "max_new_tokens": 40}
    outs = rt.generate([PROMPT, "Q:"], [greedy, sampled])
    assert len(outs) == 5
    for out in outs:
        assert member(out["text"]), (name, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    if name == "forced":  # xgrammar's jump-forward string was appended without decoding it
        assert all(out["meta_info"]["jump_forward_steps"] >= 1 for out in outs)
        assert all(out["meta_info"]["completion_tokens"] > out["meta_info"]["forward_passes"]
                   for out in outs)


def test_regex_and_json_schema_through_xgrammar(rt):
    outs = rt.generate([PROMPT] * 2, [{"regex": REGEX, "temperature": 1.0, "seed": 3, "n": 3,
                                       "max_new_tokens": 30},
                                      {"json_schema": SCHEMA, "temperature": 1.0, "seed": 5,
                                       "n": 3, "max_new_tokens": 60}])
    schema_regex = json_schema_to_regex(SCHEMA)  # lmnb's layout: both backends write it
    for out in outs[:3]:
        assert re.fullmatch(REGEX, out["text"]), out["text"]
    for out in outs[3:]:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
        assert re.fullmatch(schema_regex, out["text"]), out["text"]


def test_bad_grammars_are_clear_errors_and_the_runtime_stays_usable(rt):
    with pytest.raises(InvalidRequestError, match=r"invalid ebnf: .*Rule \"value\" is not defined"):
        rt.generate(PROMPT, {"ebnf": "root ::= value"})
    with pytest.raises(InvalidRequestError, match="invalid ebnf: .*line 1"):
        rt.generate(PROMPT, {"ebnf": 'root ::= "a" |'})
    with pytest.raises(InvalidRequestError, match="invalid regex: .*parenthesis"):
        rt.generate(PROMPT, {"regex": "(ab"})
    with pytest.raises(InvalidRequestError, match="at most one of regex, json_schema and ebnf"):
        rt.generate(PROMPT, {"ebnf": YES_NO, "regex": "yes"})
    with pytest.raises(InvalidRequestError, match="ebnf must be a non-empty grammar"):
        SamplingParams(ebnf="  ")
    assert is_yes_no(rt.generate(PROMPT, {"ebnf": YES_NO, "temperature": 0.0})["text"])
    rt.check_integrity()


# ---------------------------------------------------------------- the two backends

def test_xgrammar_masks_equal_the_fsm_masks(rt):
    """Along a valid text, xgrammar's mask (special tokens cleared, stops when complete) is
    lmnb's FSM mask for the same regex, token for token."""
    factory = GrammarFactory(rt.tokenizer, vocab_size=rt.model_config.vocab_size,
                             eos_token_ids=rt.eos_token_ids)
    params = SamplingParams(regex=REGEX)
    ours = factory.make(params)
    theirs = factory.xgrammar().matcher("regex", REGEX)
    assert isinstance(ours, RequestGrammar) and isinstance(theirs, XGrammarMatcher)
    assert isinstance(factory.make(SamplingParams(ebnf=YES_NO)), XGrammarMatcher)  # always
    stops = frozenset(rt.eos_token_ids)
    vocab = rt.model_config.vocab_size
    for token in [*rt.tokenizer.encode("123-abc?", add_special_tokens=False), None]:
        mine = unpack_bitmask(ours.bitmask(stops)[None], vocab)
        other = unpack_bitmask(theirs.bitmask(stops)[None], vocab)
        assert torch.equal(mine, other), (token, (mine ^ other).nonzero()[:5])
        assert (ours.is_final, ours.forced_text()) == (theirs.is_final, theirs.forced_text())
        if token is not None:
            ours.advance(token)
            theirs.advance(token)
    assert theirs.is_final and not theirs.is_dead
    theirs.advance(rt.tokenizer.encode("x", add_special_tokens=False)[0])
    assert theirs.is_dead and not theirs.is_final


def test_xgrammar_masks_leave_out_special_tokens_and_stop_only_when_complete(rt):
    """xgrammar reads `<|im_start|>` as its literal text; lmnb never lets a special token in."""
    factory = GrammarFactory(rt.tokenizer, vocab_size=rt.model_config.vocab_size,
                             eos_token_ids=rt.eos_token_ids)
    grammar = factory.make(SamplingParams(ebnf=r'root ::= [^.]* "."'))
    specials = sorted(set(rt.tokenizer.all_special_ids))
    stops = frozenset(rt.eos_token_ids)
    vocab = rt.model_config.vocab_size
    allowed = unpack_bitmask(grammar.bitmask(stops)[None], vocab)[0]
    assert not allowed[specials].any() and allowed.sum() > vocab // 2
    grammar.advance(rt.tokenizer.convert_tokens_to_ids("."))
    allowed = unpack_bitmask(grammar.bitmask(stops)[None], vocab)[0]
    assert allowed[sorted(stops)].all() and grammar.is_final


def test_grammar_backend_option():
    assert EngineConfig().grammar_backend == "lmnb"
    with pytest.raises(ValueError, match="grammar_backend 'outlines'; choose one of: lmnb, xgr"):
        EngineConfig(grammar_backend="outlines")


# ---------------------------------------------------------------- DSL and server

def test_gen_ebnf_in_a_program(rt):
    @lmnb.function
    def quiz(s, question):
        s += question + "\n"
        s += "Result: " + lmnb.gen("result", ebnf=ARITHMETIC, max_tokens=30, temperature=1.0,
                                   seed=1)
        s += "\nSure? " + lmnb.gen("sure", ebnf=YES_NO, max_tokens=5)

    state = quiz.run(question="What is 2+2?", backend=rt, temperature=0)
    assert is_arithmetic(state["result"]), state["result"]
    assert is_yes_no(state["sure"]), state["sure"]
    with pytest.raises(ValueError, match="at most one of regex, json_schema and ebnf"):
        lmnb.gen("x", regex="a", ebnf=YES_NO)


def test_generate_route_and_openai_extra_body(server, rt):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/generate", json={"text": PROMPT, "sampling_params": {
            "ebnf": JSONISH, "temperature": 1.0, "seed": 2, "max_new_tokens": 40}})
        assert reply.status_code == 200, reply.text
        assert is_jsonish(reply.json()["text"]), reply.json()["text"]
        bad = http.post("/generate", json={"text": PROMPT,
                                           "sampling_params": {"ebnf": "root ::= nope"}})
        assert bad.status_code == 400
        assert 'Rule "nope" is not defined' in bad.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                           extra_body={"ebnf": ARITHMETIC})
    assert is_arithmetic(completion.choices[0].text), completion.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=5,
        extra_body={"ebnf": YES_NO})
    assert is_yes_no(chat.choices[0].message.content)
    rt.check_integrity()
