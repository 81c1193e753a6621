"""Regex -> ByteFSM against `re`, token masks against brute force, compressed FSM, jump-forward."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmnb.runtime.fsm import (
    ByteFSM,
    CompressedFSM,
    InvalidRegexError,
    JumpForward,
    TokenIndex,
    compile_regex,
    get_token_index,
    token_byte_table,
    vocab_trie,
)

STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'
INT = r"-?(0|[1-9][0-9]*)"
JSON_PERSON = (r'\{"name": ' + STR + r', "age": ' + INT + r', "email": "[a-z0-9.]+@[a-z]+\.com", '
               r'"tags": \[(' + STR + r'(, ' + STR + r')*)?\], "ok": (true|false)\}')
JSON_WS = (r'\{[ \n]*"id"[ \n]*:[ \n]*[0-9]{1,6}[ \n]*(,[ \n]*"note"[ \n]*:[ \n]*' + STR
           + r')?[ \n]*\}')

REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,4}",
    r"\(?\d{3}\)?[ -]?\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"^(cat|dog|bird)s?$",
    r"^[a-c]+$|^\d$",
    r"colou?r( (red|green|blue))?",
    r"(ab|a)(bc|c)?d{0,3}",
    r"x{2,5}y{0,2}z?",
    r"\w+( \w+){0,3}",
    r"[^\"]*",
    r"[^a-z\s]{1,4}",
    r".{0,5}",
    r"(?s).{1,3}",
    r"[é日本😀-🙏]+",
    r"[\u4e00-\u9fff]{1,4}",
    r"\S+\s\S+",
    r"\W*\D?",
    r"(?i)hello( world)?",
    r"(?i)[a-fß]+",
    r"(?a)\w+\s\d",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
    r"(true|false|null)",
    r'"([^"\\]|\\.)*"',
    JSON_PERSON,
    JSON_WS,
    r"[\x00-\x7f]*\n",
    r"(a|b)*abb",
    r"((ab)*|c+)d",
]

# regexes the random walk drives on both tokenizers (shorter ones finish within 50 steps)
WALK_REGEXES = [*REGEXES[:24], r'\{"name": "[A-Z][a-z]{1,8}", "age": [1-9][0-9]?\}',
                r"(Paris|London|Berlin|Tōkyō)", r"[A-Z][a-z]+ (is|was) [0-9]{1,3}\.",
                JSON_WS, JSON_PERSON]

FILLER = "abcxyzABZ019 -_.,:;@\"'\\\n\t{}[]()éüß日本語😀🙂\u0660\u00a0ſK"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    pytest.importorskip("mistral_common")
    import mistral_common
    from transformers import LlamaTokenizer

    folder = tmp_path_factory.mktemp("mistral")
    data = Path(os.path.dirname(mistral_common.__file__)) / "data" / "tokenizer.model.v1"
    shutil.copy(data, folder / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["smollm2", "mistral"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------- regex -> ByteFSM


def _mutate(data: st.DataObject, text: str) -> str:
    chars = list(text)
    for _ in range(data.draw(st.integers(0, 3))):
        kind = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        pos = data.draw(st.integers(0, len(chars)))
        char = data.draw(st.sampled_from(FILLER) | st.characters(exclude_categories=["Cs"]))
        if kind == "insert":
            chars.insert(pos, char)
        elif chars:
            pos = min(pos, len(chars) - 1)
            if kind == "delete":
                del chars[pos]
            else:
                chars[pos] = char
    return "".join(chars)


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fullmatch_agrees_with_re(pattern: str, data: st.DataObject) -> None:
    fsm = compile_regex(pattern)
    source = data.draw(st.sampled_from(["match", "mutant", "text"]))
    if source == "text":
        text = data.draw(st.text(st.sampled_from(FILLER) | st.characters(exclude_categories=["Cs"]),
                                 max_size=12))
    else:
        text = data.draw(st.from_regex(pattern, fullmatch=True))
        if source == "mutant":
            text = _mutate(data, text)
    assert fsm.fullmatch(text) == (re.fullmatch(pattern, text) is not None), text


def test_byte_fsm_shape() -> None:
    fsm = compile_regex(r"[é日]+")
    assert fsm.fullmatch("é日é") and not fsm.fullmatch("")
    mid = fsm.next(fsm.initial, "é".encode()[0])
    assert mid >= 0 and not fsm.is_boundary(mid) and fsm.next(mid, 0x41) == -1
    assert fsm.walk(fsm.initial, "日".encode()) in fsm.accepting
    assert fsm.table.shape == (fsm.num_states + 1, 256)
    assert (fsm.table[fsm.dead] == fsm.dead).all()
    # shared continuation states keep big classes small
    assert compile_regex(r".*").num_states < 12
    assert compile_regex(r"\w+").num_states < 600
    assert compile_regex(r"(abc|abd)") is compile_regex(r"(abc|abd)")


@pytest.mark.parametrize("pattern, states, example", [
    ("a" * 5000, 5001, "a" * 5000),  # a chain: Moore's rounds were quadratic here (25 s)
    (r"(a|b)*abb", 4, "babb"),  # the textbook minimal DFA
    (r"(ab|ac)*d", 3, "abacd"),
    (r"[0-9]{1,40}", 41, "0123"),
    (r"(x|xx|xxx)(y|yy)", 6, "xxxyy"),
])
def test_minimal_state_counts(pattern: str, states: int, example: str) -> None:
    """ASCII patterns (one byte a code point): the byte FSM has the minimal DFA's states."""
    fsm = compile_regex(pattern)
    assert fsm.num_states == states
    assert fsm.fullmatch(example) and not fsm.fullmatch(example + "!")


@pytest.mark.parametrize("pattern, message", [
    (r"(?=a)a", "lookahead"),
    (r"a(?<!b)", "lookahead/lookbehind"),
    (r"(a)\1", "backreferences"),
    (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"(a)?(?(1)b|c)", "conditional"),
    (r"\bword\b", "anchors"),
    (r"a^b", "anchors"),
    (r"a*+", "possessive|invalid regex"),  # Python 3.10's re has no possessive quantifiers
    (r"(?>ab)", "atomic|invalid regex"),
    (r"a{3,1}", "invalid regex"),
    (r"[a-", "invalid regex"),
    (r"(unclosed", "invalid regex"),
    (r"[^\s\S]", "matches no string"),
    (r"(a{1000}){1000}", "too large"),
    ("(" * 2000 + ")" * 2000, "nested too deeply|invalid regex"),  # 3.12+: re.error
    (r"(a|b)*a(a|b){20}", "too large"),
])
def test_invalid_regex(pattern: str, message: str) -> None:
    with pytest.raises(InvalidRegexError, match=message):
        compile_regex(pattern)
    assert issubclass(InvalidRegexError, ValueError)


# ---------------------------------------------------------------- token bytes and masks


def test_token_byte_table(tokenizer) -> None:
    table = token_byte_table(tokenizer)
    assert token_byte_table(tokenizer) is table and len(table) == len(tokenizer)
    for special in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        assert table[special] is None
    anchor = tokenizer.encode("a", add_special_tokens=False)
    base = tokenizer.decode(anchor)
    for ident in random.Random(0).sample(range(len(table)), 2000):
        data = table[ident]
        if data is None:
            continue
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue  # part of a character
        decoded = tokenizer.decode(anchor + [ident], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
        assert decoded[len(base):] == text, ident
    text = " Hello,\n  wörld 日本 😀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids).decode().strip() == text.strip()


def _brute_allowed(index: TokenIndex, state: int) -> list[int]:
    return [i for i, data in enumerate(index.table)
            if data is not None and index.fsm.walk(state, data) >= 0]


def _distances(fsm: ByteFSM) -> list[float]:
    """Fewest bytes from each state to an accepting one (reverse BFS)."""
    back: list[list[int]] = [[] for _ in range(fsm.num_states)]
    for state, row in enumerate(fsm.transitions):
        for target in row.values():
            back[target].append(state)
    dist = [math.inf] * fsm.num_states
    queue = list(fsm.accepting)
    for state in queue:
        dist[state] = 0
    for state in queue:
        for prev in back[state]:
            if dist[prev] == math.inf:
                dist[prev] = dist[state] + 1
                queue.append(prev)
    return dist


def _random_walk(index: TokenIndex, rng: random.Random, steps: int = 50,
                 stop_p: float = 0.3) -> tuple[list[int], list[int]]:
    """Random allowed tokens from the initial state; half the time the candidate (16 random
    allowed tokens and the one-byte tokens) that gets closest to acceptance, so walks finish.
    Returns (token ids, states visited)."""
    dist = _distances(index.fsm)
    one_byte = {data[0]: i for i, data in enumerate(index.table) if data and len(data) == 1}
    state, ids, states = index.initial, [], [index.initial]
    for _ in range(steps):
        if index.is_final(state) or (index.is_accepting(state) and rng.random() < stop_p):
            break
        allowed = index.allowed(state).nonzero().flatten()
        assert len(allowed), (index.fsm.pattern, state)
        picks = [int(allowed[rng.randrange(len(allowed))]) for _ in range(16)]
        if rng.random() < 0.5:
            picks += [one_byte[b] for b in index.fsm.transitions[state] if b in one_byte]
            rng.shuffle(picks)
            picks.sort(key=lambda t: dist[index.next_state(state, t)])
        token = picks[0]
        state = index.next_state(state, token)
        assert state >= 0
        ids.append(token)
        states.append(state)
    return ids, states


@pytest.mark.parametrize("pattern", [JSON_PERSON, r"[é日本😀-🙏]+", r"\w+( \w+){0,3}",
                                     r"(?i)hello( world)?"])
def test_mask_equals_brute_force(tokenizer, pattern: str) -> None:
    index = get_token_index(pattern, tokenizer)
    rng = random.Random(1)
    states = {index.initial}
    for _ in range(3):
        states.update(_random_walk(index, rng, steps=12)[1])
    for state in rng.sample(sorted(states), min(4, len(states))):
        mask = index.allowed(state)
        assert mask.dtype == torch.bool and mask.shape == (len(tokenizer),)
        assert mask.nonzero().flatten().tolist() == _brute_allowed(index, state)
    assert not index.allowed(-1).any()
    assert index.next_state(index.initial, tokenizer.eos_token_id) == -1


@pytest.mark.parametrize("pattern", WALK_REGEXES)
def test_random_walk_generation(tokenizer, pattern: str) -> None:
    """Sampling only allowed tokens yields text that fullmatches once the FSM accepts."""
    index = get_token_index(pattern, tokenizer)
    table = token_byte_table(tokenizer)
    rng = random.Random(zlib.crc32(pattern.encode()))
    finished = 0
    for _ in range(3):
        ids, states = _random_walk(index, rng)
        data = b"".join(table[i] for i in ids)
        assert index.fsm.walk(index.initial, data) == states[-1]
        if index.is_accepting(states[-1]):
            assert re.fullmatch(pattern, data.decode()), data
            finished += 1
    assert finished >= 1


def test_shared_index_and_build_all(smollm2) -> None:
    index = get_token_index(JSON_PERSON, smollm2)
    assert get_token_index(JSON_PERSON, smollm2) is index
    assert get_token_index(JSON_PERSON, smollm2, vocab_size=49280).allowed(0).shape == (49280,)
    fresh = TokenIndex(index.fsm, index.table, vocab_trie(smollm2))
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.append(fresh.allowed(5)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is results[0] for r in results)
    assert fresh.build_all() == fresh.num_computed
    assert torch.equal(fresh.allowed(7), index.allowed(7))


# ---------------------------------------------------------------- compressed FSM and jump-forward


def test_forced_bytes() -> None:
    index_fsm = compile_regex(r'\{"name": "[a-z]+", "age": [0-9]+\}')
    compressed = CompressedFSM(index_fsm)
    assert compressed.forced_bytes(index_fsm.initial) == b'{"name": "'
    after_name = index_fsm.walk(index_fsm.initial, b'{"name": "bob')
    assert compressed.forced_bytes(after_name) == b""  # more letters or the closing quote
    after_quote = index_fsm.walk(after_name, b'"')
    assert compressed.forced_bytes(after_quote) == b', "age": '
    done = compile_regex(r"(ab)?")
    assert CompressedFSM(done).forced_bytes(done.initial) == b""  # accepting: may stop
    partial = compile_regex(r"x[éè]")  # é and è share the lead byte: cut to whole characters
    assert CompressedFSM(partial).forced_bytes(partial.initial) == b"x"
    utf8 = compile_regex(r"日本(a|b)")
    assert CompressedFSM(utf8).forced_bytes(utf8.initial) == "日本".encode()
    mid = utf8.next(utf8.initial, "日".encode()[0])
    assert CompressedFSM(utf8).forced_bytes(mid) == b""


def _prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ([tokenizer.bos_token_id] + ids) if tokenizer.bos_token_id is not None else ids


def _check_plan(tokenizer, jump: JumpForward, prompt: list[int], output: list[int],
                forced: str) -> bool:
    plan = jump.plan(prompt, output, forced)
    if plan is None:
        return False
    old_text = tokenizer.decode(prompt + output, skip_special_tokens=False)
    new_text = tokenizer.decode(prompt + plan.new_output_ids, skip_special_tokens=False)
    assert new_text == old_text + forced
    assert jump.output_bytes(plan.new_output_ids) == jump.output_bytes(output) + forced.encode()
    assert plan.new_output_ids[:plan.keep] == output[:plan.keep]
    new_ids = tokenizer.encode(new_text, add_special_tokens=False)
    assert new_ids[:len(prompt)] == prompt  # the prompt never changes
    return True


@pytest.mark.parametrize("context_tokens", [None, 6])
def test_jump_forward_plans(tokenizer, context_tokens: int | None) -> None:
    jump = JumpForward(tokenizer, context_tokens=context_tokens)
    prompt = _prompt(tokenizer, "Give me a JSON object describing a person.\nAnswer:")
    index = get_token_index(JSON_PERSON, tokenizer)
    rng = random.Random(3)
    jumped = 0
    for _ in range(12):
        ids, states = _random_walk(index, rng, steps=rng.randint(0, 14), stop_p=0.0)
        forced = index.forced_bytes(states[-1])
        if forced:
            jumped += _check_plan(tokenizer, jump, prompt, ids, forced.decode())
    assert jumped >= 3
    assert jump.plan(prompt, [], "") is None
    # the forced text would merge with the last prompt token (" is" + "land" -> " island")
    merged = _prompt(tokenizer, "The answer is")
    assert jump.plan(merged, [], "land") is None


def test_jump_forward_in_loop(tokenizer) -> None:
    """Generation with jump-forward: masks between jumps, forced text spliced in by re-tokenizing;
    the state after a jump is recomputed from the new output's bytes."""
    pattern = r'\{"name": "[A-Z][a-z]{1,8}", "age": [1-9][0-9]?, "city": "(Paris|London)"\}'
    index = get_token_index(pattern, tokenizer)
    jump = JumpForward(tokenizer)
    prompt = _prompt(tokenizer, "Person:\n")
    rng = random.Random(5)
    output: list[int] = []
    state = index.initial
    jumps = 0
    for _ in range(60):
        if index.is_final(state):
            break
        forced = index.forced_bytes(state)
        plan = jump.plan(prompt, output, forced.decode()) if forced else None
        if plan is not None:
            output = plan.new_output_ids
            state = index.fsm.walk(index.initial, jump.output_bytes(output))
            jumps += 1
            continue
        token = rng.choice(index.allowed(state).nonzero().flatten().tolist())
        output.append(token)
        state = index.next_state(state, token)
    assert index.is_final(state) and jumps >= 2
    text = tokenizer.decode(prompt + output, skip_special_tokens=False)
    prefix = tokenizer.decode(prompt, skip_special_tokens=False)
    assert re.fullmatch(pattern, text[len(prefix):])
