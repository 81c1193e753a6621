"""Incremental prompt tokenization (`lmnb.lang.prompt_tokens`) gives exactly the ids of
tokenizing each whole prompt, with SmolLM2's real tokenizer."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import pytest

from lmnb.lang.prompt_tokens import PromptTokens, prompt_tokens, safe_boundary

PIECES = ["the", " cat", " sat", "s", "'s", " don't", "1", "23", "456", ".", ",", "?!", " ",
          "  ", "\n", "\n\n", "\t", " \n", "é", " naïve", "日本", "<|im_start|>", "<|im_end|>",
          "user", "assistant", "A", " B", "Answer:", " (", ")", "-", "--", "x" * 12]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Any:
    from lmnb.runtime.models import loader

    return loader.load_tokenizer(smollm2_dir)


def whole(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


def text_of(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(pieces))


def test_smollm2_encodes_incrementally(tokenizer) -> None:
    assert PromptTokens(tokenizer).incremental


def test_growing_and_forked_prompts_match_whole_tokenization(tokenizer) -> None:
    """Prompts that grow piece by piece (a turn appended, text appended right after a word, so
    that a token straddles the old end) and forks of one prefix into different continuations."""
    rng = random.Random(0)
    tokens = PromptTokens(tokenizer)
    for _ in range(40):
        prompt = text_of(rng, 60)
        for _ in range(6):
            prompt += text_of(rng, rng.randint(1, 12))
            assert tokens.encode(prompt) == whole(tokenizer, prompt), prompt
        for _ in range(3):  # forks: the same parent, different tails
            branch = prompt + text_of(rng, rng.randint(1, 20))
            assert tokens.encode(branch) == whole(tokenizer, branch), branch
        cut = prompt[:rng.randint(1, len(prompt))]  # a shorter prompt than one cached
        assert tokens.encode(cut) == whole(tokenizer, cut), cut
    assert tokens.reused_chars > tokens.encoded_chars  # it did reuse


def test_words_straddling_the_cached_end(tokenizer) -> None:
    """The cached prompt ends inside what becomes one token (a word, a number, a run of
    spaces or newlines) of the longer prompt."""
    tokens = PromptTokens(tokenizer)
    base = "The following are multiple choice questions about history and art. " * 3
    for first, then in [("Answ", "er: B"), ("12", "34 apples"), ("end ", " spaces"),
                        ("line\n", "\nnext"), ("don", "'t stop"), ("x.", "..y"),
                        ("<|im_", "start|>user"), ("caf", "é au lait"), ("a \n", "  b")]:
        short, long = base + first, base + first + then
        assert tokens.encode(short) == whole(tokenizer, short)
        assert tokens.encode(long) == whole(tokenizer, long), long


def test_chat_template_turns(tokenizer) -> None:
    """Conversations rendered by the model's chat template, turn by turn and forked."""
    tokens = PromptTokens(tokenizer)
    rng = random.Random(1)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    for _ in range(6):
        messages.append({"role": "user", "content": text_of(rng, 15)})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        assert tokens.encode(rendered) == whole(tokenizer, rendered)
        for fork in range(2):
            branch = rendered + f"Idea {fork + 1}: " + text_of(rng, 8)
            assert tokens.encode(branch) == whole(tokenizer, branch)
        messages.append({"role": "assistant", "content": text_of(rng, 10)})


def test_safe_boundary_rule() -> None:
    assert safe_boundary("ab cd", 2)
    assert safe_boundary("ab\ncd", 2)
    assert not safe_boundary("ab  cd", 3)  # a space on the left
    assert not safe_boundary("abcd", 2)  # a letter on the right
    assert not safe_boundary("é cd", 1)  # not ASCII on the left
    assert not safe_boundary("ab ", 0) and not safe_boundary("ab", 2)


def test_other_tokenizers_encode_whole(tokenizer) -> None:
    """A tokenizer whose pre-tokenizer is not GPT-2's byte-level regex is never split."""
    from tokenizers import pre_tokenizers

    copy = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    copy.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokens = PromptTokens(copy)
    assert not tokens.incremental
    text = "The following are questions. " * 4 + "Answer: B"
    assert tokens.encode(text) == copy.encode(text, add_special_tokens=True)


def test_one_cache_per_tokenizer(tokenizer) -> None:
    assert prompt_tokens(tokenizer) is prompt_tokens(tokenizer)
    assert prompt_tokens(None) is None


class IdsRecorder:
    """A runtime stand-in with the real tokenizer: records what `LocalBackend` sends."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sent: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def cache_prefix(self, prompt: str | None = None, *, input_ids: Any = None) -> int:
        self.sent.append({"input_ids": input_ids, "prompt": prompt})
        return 0

    def batched_submits(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_local_backend_sends_the_runtime_ids(tokenizer) -> None:
    from lmnb.lang.backends.local import LocalBackend

    recorder = IdsRecorder(tokenizer)
    backend = LocalBackend(recorder)
    prompts = ["Question: what is 2 + 2?\nAnswer: 4\n\n" * 3 + tail
               for tail in ("Question: 3 + 3?", "Question: 5 + 5?\nAnswer:")]
    for prompt in prompts:
        backend.cache_prefix(prompt)
    assert [s["input_ids"] for s in recorder.sent] == [recorder.encode(p) for p in prompts]


def test_cached_byte_ends_match_the_ids(tokenizer) -> None:
    """Each cached prompt's token ends (built from a reused prefix plus a new tail) are its
    ids' byte lengths added up, ending at the text's UTF-8 length."""
    tokens = PromptTokens(tokenizer)
    rng = random.Random(2)
    prompt = text_of(rng, 80)
    for _ in range(10):
        prompt += text_of(rng, 10)
        tokens.encode(prompt)
    for text, entry in tokens._entries.items():
        ends, total = [], 0
        for token in entry.ids:
            total += tokens._lengths[token]
            ends.append(total)
        assert list(entry.ends) == ends and total == len(text.encode("utf-8"))


class _CallLog:
    """A tokenizer backend whose single and batch encode calls are counted."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[str] = []

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("encode")
        return self.backend.encode(*args, **kwargs)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("encode_batch")
        return self.backend.encode_batch(*args, **kwargs)


def test_long_texts_are_tokenized_by_the_batch_call(tokenizer) -> None:
    """A few-shot prompt is tokenized by the backend's batch call (which releases the GIL while
    it works: the scheduler thread runs meanwhile); a short tail by the single call. The ids
    stay exact."""
    rng = random.Random(3)
    prefix = " ".join(text_of(rng, 8) for _ in range(400))
    assert len(prefix) > 3000
    tokens = PromptTokens(tokenizer)
    log = _CallLog(tokens.backend)
    tokens.backend = log  # type: ignore[assignment]
    first, second = prefix + " Q: one?", prefix + " Q: two?"
    assert tokens.encode(first) == whole(tokenizer, first)
    assert tokens.encode(second) == whole(tokenizer, second)  # the prefix reused
    assert log.calls == ["encode_batch", "encode"]


def test_shared_prefix_length() -> None:
    """The windowed binary search finds the common prefix's exact length (and `_shares`
    agrees), for texts differing anywhere, one a prefix of the other, or equal."""
    from lmnb.lang.prompt_tokens import _shared_prefix, _shares

    rng = random.Random(5)
    for _ in range(300):
        a = "".join(rng.choice("ab é") for _ in range(rng.randrange(0, 60)))
        b = a[:rng.randrange(0, len(a) + 1)] + "".join(
            rng.choice("ab é") for _ in range(rng.randrange(0, 20)))
        shorter = min(len(a), len(b))
        expected = next((i for i in range(shorter) if a[i] != b[i]), shorter)
        assert _shared_prefix(a, b) == _shared_prefix(b, a) == expected, (a, b)
        for count in range(len(a) + 3):
            assert _shares(a, b, count) == (len(a) >= count <= len(b) and a[:count] == b[:count])


def test_encode_many_matches_whole_tokenization(tokenizer) -> None:
    """Texts encoded together (a loop turn's prompts): groups sharing a prefix nobody has
    encoded yet, texts extending remembered ones, duplicates, short and empty texts; each
    gets exactly its own ids, and a group's prefix is tokenized once."""
    rng = random.Random(5)
    tokens = PromptTokens(tokenizer)
    prefixes = [" ".join(text_of(rng, 8) for _ in range(30)) + "\n" for _ in range(3)]
    texts = [prefix + text_of(rng, rng.randint(1, 10)) for prefix in prefixes for _ in range(6)]
    texts += [texts[0], texts[1] + " more", "", "A", text_of(rng, 4)]
    rng.shuffle(texts)
    assert tokens.encode_many(texts) == [whole(tokenizer, text) for text in texts]
    assert tokens.reused_chars > tokens.encoded_chars  # the groups' prefixes: once each
    grown = [text + text_of(rng, rng.randint(1, 10)) for text in texts]  # the next turn
    log = _CallLog(tokens.backend)
    tokens.backend = log  # type: ignore[assignment]
    assert tokens.encode_many(grown) == [whole(tokenizer, text) for text in grown]
    assert log.calls == ["encode_batch"]  # every text extends a remembered one: one call


def test_turn_tokens_encode_one_turns_prompts_together(tokenizer) -> None:
    """`TurnTokens`: the prompts asked for in one turn of the program loop are tokenized by
    one batch call at its end, each waiter gets exactly its own ids; a cancelled waiter is
    skipped and a failing call fails every waiter of the turn. On another loop: at once."""
    import asyncio

    from lmnb.lang.backends.turn_tokens import TurnTokens
    from lmnb.lang.event_loop import block_on

    rng = random.Random(7)
    prefix = " ".join(text_of(rng, 8) for _ in range(30)) + "\n"
    texts = [prefix + text_of(rng, rng.randint(1, 10)) for _ in range(6)] + ["short", ""]
    tokens = PromptTokens(tokenizer)
    log = _CallLog(tokens.backend)
    tokens.backend = log  # type: ignore[assignment]
    turn = TurnTokens(tokens)

    async def main() -> list[Any]:
        cancelled = asyncio.ensure_future(turn.encode(texts[0]))
        waiters = [asyncio.ensure_future(turn.encode(text)) for text in texts]
        await asyncio.sleep(0)  # the waiters ask in this turn
        cancelled.cancel()
        return await asyncio.gather(*waiters)

    assert block_on(main()) == [whole(tokenizer, text) for text in texts]
    # the group's first text, then the others after it (they reuse its ids)
    assert log.calls == ["encode_batch", "encode_batch"]
    log.calls.clear()
    assert asyncio.run(turn.encode("elsewhere")) == whole(tokenizer, "elsewhere")
    assert log.calls == ["encode"]

    def broken(texts: Any) -> list[list[int]]:
        raise RuntimeError("tokenizer failed")

    tokens.encode_many = broken  # type: ignore[method-assign]

    async def failing() -> list[Any]:
        return await asyncio.gather(turn.encode("a"), turn.encode("b"),
                                    return_exceptions=True)

    assert [str(error) for error in block_on(failing())] == ["tokenizer failed"] * 2
