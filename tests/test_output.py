"""The output side: TokenEvent batches -> OutputProcessor (detokenization off the scheduler
thread) -> OutputStream consumed by threads and asyncio; the scheduler's stop rule agrees with
the output's trim."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import pytest

from lmnb.params import SamplingParams
from lmnb.runtime.output import OutputProcessor, OutputStream, TokenEvent
from lmnb.runtime.output.stop_text import StopText
from tests import test_detokenizer
from tests.test_detokenizer import TEXTS, _byte_ids, _encode, _expected

# The real tokenizers (SmolLM2 byte-level BPE, Mistral SentencePiece) as fixtures here too.
smollm2, mistral, tok = test_detokenizer.smollm2, test_detokenizer.mistral, test_detokenizer.tok

EOS = 256
STOP = {"type": "stop", "matched": "x"}
LENGTH = {"type": "length", "length": 0}


class ByteTokenizer:
    """Ids 0-255 are bytes; 256 is a special token; 300 and 301 are the pieces "abc", "def"."""

    PIECES = {300: b"abc", 301: b"def"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts = []
        for i in ids:
            if i < 256:
                parts.append(bytes([i]))
            elif i == EOS:
                parts.append(b"" if skip_special_tokens else b"<eos>")
            else:
                parts.append(self.PIECES[i])
        return b"".join(parts).decode("utf-8", errors="replace")


BYTES = ByteTokenizer()


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def open_stream(processor: OutputProcessor, rids: list[int], *, stop=(), skip=True,
                **kwargs) -> OutputStream:
    stream = OutputStream(rids, **kwargs)
    for rid in rids:
        processor.register(stream, rid, tokenizer=BYTES, prompt_ids=ids_of("Q: "),
                           skip_special_tokens=skip, stop=stop)
    return stream


def steps_of(rid: int, ids: list[int], reason: dict | None = None) -> list[list[TokenEvent]]:
    """One event per token; the last one finishes the request."""
    return [[TokenEvent(rid, [t], (reason or LENGTH) if k == len(ids) - 1 else None)]
            for k, t in enumerate(ids)]


def drain(stream: OutputStream) -> list[dict]:
    chunks = []
    while (chunk := stream.get(timeout=0)) is not None:
        chunks.append(chunk)
    return chunks


@pytest.fixture
def processor():
    p = OutputProcessor()
    yield p
    p.close()


@pytest.fixture
def running():
    p = OutputProcessor()
    p.start()
    yield p
    p.close()


# ---- thread and asyncio consumers --------------------------------------------------------------
def test_thread_consumer_gets_every_chunk(running):
    text = "Hello, wörld — 你好 😀!"
    stream = open_stream(running, [7])
    steps = steps_of(7, ids_of(text))
    producer = threading.Thread(target=lambda: [running.put(step) for step in steps])
    producer.start()
    chunks = list(stream)
    producer.join()
    assert "".join(c["text"] for c in chunks) == text
    assert [i for c in chunks for i in c["output_ids"]] == ids_of(text)
    assert len(chunks) == len(steps)  # one chunk per step, also when the text is held back
    assert all(c["meta_info"] == {"id": "7", "prompt_tokens": 3, "finish_reason": None,
                                  "completion_tokens": k} for k, c in enumerate(chunks[:-1], 1))
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == LENGTH and last["completion_tokens"] == len(steps)
    assert stream.finished and stream.get(timeout=0) is None


def test_asyncio_consumer_is_woken_by_the_output_thread(running):
    text = "async ✓ streaming"
    ids = ids_of(text)
    stream = open_stream(running, [1])
    taken = threading.Semaphore(0)

    def produce() -> None:
        # One step at a time, each after the consumer took the previous chunk: the consumer
        # waits on its loop between steps, so only the thread-safe wake-up can resume it.
        for step in steps_of(1, ids):
            running.put(step)
            taken.acquire()

    async def consume() -> list[dict]:
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            taken.release()
        return chunks

    producer = threading.Thread(target=produce)
    producer.start()
    chunks = asyncio.run(asyncio.wait_for(consume(), timeout=60))
    producer.join()
    assert "".join(c["text"] for c in chunks) == text
    assert chunks[-1]["meta_info"]["finish_reason"] == LENGTH


def test_a_step_wakes_each_loop_once_after_its_last_delivery(processor):
    """Many single-request streams awaited on one loop: the step's deliveries wake the loop in
    one burst, sent after the last of them (`held_wakes`), and every awaiting task resumes."""
    from lmnb.runtime.output import loop_waker

    loop = asyncio.new_event_loop()
    streams = [open_stream(processor, [rid], incremental=False) for rid in range(1, 9)]
    wakes: list[int] = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(callback, *args):
        if getattr(callback, "__func__", None) is loop_waker.LoopWaker._flush:
            wakes.append(len(args))
        return call_soon_threadsafe(callback, *args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    async def consume(stream: OutputStream) -> list[dict]:
        return await stream.aresults()

    async def main() -> list[list[dict]]:
        tasks = [asyncio.ensure_future(consume(stream)) for stream in streams]
        await asyncio.sleep(0)  # every task awaits its stream

        def step() -> None:  # an outer block: the processor's own one nests in it
            with loop_waker.held_wakes():
                processor.process([TokenEvent(rid, [5], LENGTH) for rid in range(1, 9)])
                assert wakes == []  # held until the block ends
        await asyncio.to_thread(step)
        return await asyncio.gather(*tasks)

    try:
        processor.pump()  # the registrations
        results = loop.run_until_complete(asyncio.wait_for(main(), timeout=60))
    finally:
        loop.close()
    assert len(wakes) == 1
    assert [r[0]["meta_info"]["finish_reason"] for r in results] == [LENGTH] * 8


def test_asyncio_results_of_a_whole_call(running):
    stream = open_stream(running, [1, 2], incremental=False)
    running.put([TokenEvent(1, ids_of("ab")), TokenEvent(2, ids_of("xy"))])
    running.put([TokenEvent(2, ids_of("z"), LENGTH, meta={"cached_tokens": 2}),
                 TokenEvent(1, ids_of("c"), LENGTH)])
    results = asyncio.run(asyncio.wait_for(stream.aresults(), timeout=60))
    assert [r["text"] for r in results] == ["abc", "xyz"]
    assert [r["output_ids"] for r in results] == [ids_of("abc"), ids_of("xyz")]
    assert results[1]["meta_info"]["cached_tokens"] == 2
    assert results[0]["meta_info"]["completion_tokens"] == 3


def test_several_requests_interleaved(running):
    rng = random.Random(0)
    texts = {10: "first request ü", 11: "second 😀😀", 12: "third — ok"}
    streams = {"a": open_stream(running, [10, 11], tagged=True),
               "b": open_stream(running, [12], incremental=False)}
    pending = {rid: steps_of(rid, ids_of(t)) for rid, t in texts.items()}
    batches = []
    while pending:  # each step batches a random subset of the live requests
        rids = rng.sample(sorted(pending), rng.randint(1, len(pending)))
        batches.append([pending[rid].pop(0)[0] for rid in rids])
        pending = {rid: s for rid, s in pending.items() if s}
    producer = threading.Thread(target=lambda: [running.put(b) for b in batches])
    producer.start()
    chunks = list(streams["a"])
    whole = streams["b"].results()
    producer.join()
    for index, rid in enumerate([10, 11]):
        mine = [c for c in chunks if c["index"] == index]
        assert all(c["meta_info"]["id"] == str(rid) for c in mine)
        assert "".join(c["text"] for c in mine) == texts[rid]
        assert mine[-1]["meta_info"]["finish_reason"] is not None
    assert whole == [{"text": texts[12], "output_ids": ids_of(texts[12]),
                      "meta_info": whole[0]["meta_info"]}]
    assert whole[0]["meta_info"]["finish_reason"] == LENGTH


# ---- text --------------------------------------------------------------------------------------
def test_split_characters_are_never_emitted_half(processor):
    text = "é😀你ǅ a𝔘"
    stream = open_stream(processor, [0])
    for step in steps_of(0, ids_of(text)):
        processor.put(step)
    processor.pump()
    texts = [c["text"] for c in drain(stream)]
    assert "".join(texts) == text
    assert [t for t in texts if t] == list(text)  # each character whole, on its last byte


def test_stop_string_across_tokens_is_trimmed(processor):
    stream = open_stream(processor, [0], stop=["</a>"])
    ids = ids_of("answer</a>junk")
    end = len(ids_of("answer</a>"))
    for k in range(end):
        processor.put([TokenEvent(0, [ids[k]], {"type": "stop", "matched": "</a>"}
                                  if k == end - 1 else None)])
    processor.pump()
    chunks = drain(stream)
    assert "".join(c["text"] for c in chunks) == "answer"
    assert "".join(c["text"] for c in chunks[:-1]) == "answer"  # "</a" was held back
    assert chunks[-1]["meta_info"]["finish_reason"]["matched"] == "</a>"


def test_stop_token_id_stays_out_of_the_text(processor):
    streams = [open_stream(processor, [rid], skip=False) for rid in (0, 1)]
    processor.put([TokenEvent(0, ids_of("hi") + [EOS], {"type": "stop", "matched": EOS}),
                   TokenEvent(1, ids_of("hi") + [EOS], LENGTH)])
    processor.pump()
    (stopped,), (cut,) = drain(streams[0]), drain(streams[1])
    assert stopped["text"] == "hi" and stopped["output_ids"] == [*ids_of("hi"), EOS]
    assert cut["text"] == "hi<eos>"


def test_replace_output_ids(processor):
    stream = open_stream(processor, [0], incremental=True)
    processor.put([TokenEvent(0, ids_of("ab"))])
    # Jump-forward re-tokenized "ab" + forced "cdef" as the pieces "abc" "def".
    processor.put([TokenEvent(0, [300, 301], replace_output_ids=[300, 301])])
    processor.put([TokenEvent(0, ids_of("!"), LENGTH)])
    processor.pump()
    chunks = drain(stream)
    assert [c["text"] for c in chunks] == ["ab", "cdef", "!"]
    assert chunks[1]["output_ids"] == [300, 301]
    assert chunks[1]["meta_info"]["output_ids_from"] == 0  # they replace the ids so far
    assert chunks[-1]["meta_info"]["completion_tokens"] == 3
    assert stream.merge(chunks)[0]["output_ids"] == [300, 301, *ids_of("!")]
    # Non-incremental: the whole ids are the replaced ones.
    whole = open_stream(processor, [1], incremental=False)
    processor.put([TokenEvent(1, ids_of("ab"))])
    processor.put([TokenEvent(1, [300, 301], replace_output_ids=[300, 301])])
    processor.put([TokenEvent(1, [], LENGTH)])
    processor.pump()
    (result,) = drain(whole)
    assert result["text"] == "abcdef" and result["output_ids"] == [300, 301]


def test_replace_that_holds_back_delivered_text(processor):
    # The new detokenizer reads the ids whole and holds "ab" back (an incomplete "é" follows);
    # "ab" was already delivered, so it is not delivered twice.
    e = ids_of("é")
    stream = open_stream(processor, [0])
    processor.put([TokenEvent(0, ids_of("ab"))])
    processor.put([TokenEvent(0, e[:1], replace_output_ids=ids_of("ab") + e[:1])])
    processor.put([TokenEvent(0, e[1:], LENGTH)])
    processor.pump()
    assert [c["text"] for c in drain(stream)] == ["ab", "", "é"]


def _first_hit(tok, prompt: list[int], ids: list[int], stops: list[str]) -> tuple[int, str | None]:
    """Where the scheduler's stop rule ends a request fed `ids` one by one."""
    watcher = StopText(tok, prompt, SamplingParams(stop=stops))
    for t in range(1, len(ids) + 1):
        watcher.add([ids[t - 1]])
        if watcher.matched is not None:
            return t, watcher.matched
    return len(ids), None


def _visible(tok, prompt: list[int], ids: list[int]) -> str:
    return _expected(tok, prompt, ids).rstrip("\ufffd")


def test_scheduler_stop_rule_agrees_with_the_output_trim(tok):
    rng = random.Random(5)
    processor = OutputProcessor()
    prompts = [[], _encode(tok, "User: go on.\nAssistant:")]
    cases = 0
    for text in TEXTS:
        for _ in range(4):
            start = rng.randrange(len(text))
            stops = [text[start:start + rng.randint(1, 7)], "never-seen-xyz"]
            if rng.random() < 0.5:
                stops.append(" " + text.split()[rng.randrange(len(text.split()))][:3])
            for byte_split in (False, True):
                ids = _byte_ids(tok, text) if byte_split else _encode(tok, text)
                prompt = rng.choice(prompts)
                t, hit = _first_hit(tok, prompt, ids, stops)
                full = _visible(tok, prompt, ids[:t])
                if hit is None:
                    assert not any(s in _visible(tok, prompt, ids) for s in stops)
                    continue
                cases += 1
                # The rule fires on the first token whose text shows a stop, not later.
                assert hit in full
                assert not any(s in _visible(tok, prompt, ids[:t - 1]) for s in stops)
                ends = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
                assert min(ends)[2] == hit
                # The output side cuts at that same occurrence.
                stream = OutputStream([0])
                processor.register(stream, 0, tokenizer=tok, prompt_ids=prompt, stop=stops)
                for k in range(t):
                    processor.put([TokenEvent(0, [ids[k]], {"type": "stop", "matched": hit}
                                              if k == t - 1 else None)])
                processor.pump()
                assert "".join(c["text"] for c in drain(stream)) == full[:min(ends)[1]]
    assert cases > 20
    processor.close()


def test_scheduler_stop_rule_reads_only_a_short_tail(smollm2):
    class Counting:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return smollm2.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = _encode(smollm2, " ".join(TEXTS) * 3)
    assert _first_hit(Counting(), [], ids, ["never-seen-xyz"]) == (len(ids), None)
    # Bounded by the stop's length (a character may take 4 byte tokens; the window doubles).
    assert len(ids) > 300 and Counting.longest <= 8 * len("never-seen-xyz")


# ---- closing -----------------------------------------------------------------------------------
def test_leaving_the_loop_early_calls_back_with_the_unfinished(processor):
    closed: list[list[int]] = []
    stream = open_stream(processor, [0, 1, 2], on_close=closed.append)
    processor.put([TokenEvent(0, ids_of("a"), LENGTH), TokenEvent(1, ids_of("b"))])
    processor.pump()
    for chunk in stream:
        if chunk["meta_info"]["id"] == "1":
            break
    assert closed == [[1, 2]] and stream.closed
    processor.put([TokenEvent(1, ids_of("c"), LENGTH)])  # delivery after close is dropped
    processor.pump()
    assert stream.get(timeout=0) is None
    stream.close()
    assert closed == [[1, 2]]


def test_a_finished_stream_closes_without_callback(processor):
    closed: list[list[int]] = []
    stream = open_stream(processor, [0], on_close=closed.append)
    processor.put([TokenEvent(0, ids_of("a"), LENGTH)])
    processor.pump()
    assert len(list(stream)) == 1 and stream.closed and closed == []


def test_cancelling_the_async_consumer_calls_back(processor):
    closed: list[list[int]] = []
    stream = open_stream(processor, [0], on_close=closed.append)

    async def main() -> None:
        got_one = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                got_one.set()

        task = asyncio.create_task(consume())
        processor.put([TokenEvent(0, ids_of("a"))])
        processor.pump()
        await asyncio.wait_for(got_one.wait(), timeout=60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert closed == [[0]]


def test_poll_errors_end_a_blocked_consumer(processor):
    closed: list[list[int]] = []

    def poll() -> None:
        raise RuntimeError("the scheduler failed")

    stream = open_stream(processor, [0], on_close=closed.append, poll=poll, poll_interval=0.001)
    with pytest.raises(RuntimeError, match="scheduler failed"):
        stream.results()
    assert closed == [[0]]
    with pytest.raises(queue.Empty):
        OutputStream([1]).get(timeout=0)


def test_closing_the_processor_fails_waiting_streams():
    processor = OutputProcessor()
    processor.start()
    stream = open_stream(processor, [0])
    processor.put([TokenEvent(0, ids_of("a"))])
    processor.close()  # handles what was put, then fails the unfinished
    assert stream.get(timeout=0)["text"] == "a"
    with pytest.raises(RuntimeError, match="closed"):
        stream.get(timeout=0)


def test_a_failing_tokenizer_fails_only_its_stream(processor):
    class Broken:
        def decode(self, ids, skip_special_tokens=True):
            if 0 in ids:
                raise ValueError("bad id")
            return BYTES.decode(ids, skip_special_tokens)

    bad, good = OutputStream([0]), OutputStream([1])
    processor.register(bad, 0, tokenizer=Broken(), prompt_ids=[])
    processor.register(good, 1, tokenizer=BYTES, prompt_ids=[])
    processor.put([TokenEvent(0, [0], LENGTH), TokenEvent(1, ids_of("ok"), LENGTH)])
    processor.pump()
    with pytest.raises(ValueError, match="bad id"):
        bad.get(timeout=0)
    assert good.results()[0]["text"] == "ok"


def test_a_tokenizer_failing_on_the_prompt_fails_only_its_stream(running):
    """The prompt's tail is decoded when the request is registered, on the output thread: a
    failure there ends that stream, and the thread goes on serving the others."""
    class Broken:
        def decode(self, ids, skip_special_tokens=True):
            raise OverflowError("number too large to fit in target type")

    bad, good = OutputStream([0]), OutputStream([1])
    running.register(bad, 0, tokenizer=Broken(), prompt_ids=ids_of("Q: "))
    running.register(good, 1, tokenizer=BYTES, prompt_ids=ids_of("Q: "))
    running.put([TokenEvent(0, ids_of("no"), LENGTH), TokenEvent(1, ids_of("ok"), LENGTH)])
    with pytest.raises(OverflowError, match="too large"):
        bad.results()
    assert good.results()[0]["text"] == "ok"


def test_stops_completed_by_one_jump_end_first_wins(tok):
    ids = _encode(tok, "xx abcdef yy")
    for stops in (["abcdef", "cd"], ["cd", "abcdef"], ["bcde", "abcd"]):
        watcher = StopText(tok, [], SamplingParams(stop=stops))
        watcher.add(ids)
        hit = watcher.matched
        det_stream = OutputStream([0])
        processor = OutputProcessor()
        processor.register(det_stream, 0, tokenizer=tok, prompt_ids=[], stop=stops)
        processor.put([TokenEvent(0, ids, {"type": "stop", "matched": hit})])
        processor.pump()
        text = drain(det_stream)[0]["text"]
        assert hit == ("cd" if "cd" in stops else "abcd") and text == "xx ab"[:len(text)]
        assert text == ("xx ab" if hit == "cd" else "xx ")


def test_register_checks_the_stream(processor):
    with pytest.raises(ValueError, match="not one of"):
        processor.register(OutputStream([1]), 2, tokenizer=BYTES, prompt_ids=[])


def test_registrations_of_many_requests_are_one_message(processor):
    streams = [OutputStream([rid]) for rid in range(3)]
    processor.register_many([processor.registration(stream, rid, tokenizer=BYTES, prompt_ids=[])
                             for rid, stream in enumerate(streams)])
    assert processor.pump() == 1  # one inbox item: one wake-up of the output thread
    processor.put([TokenEvent(rid, ids_of(f"r{rid}"), LENGTH) for rid in range(3)])
    processor.pump()
    assert [stream.results()[0]["text"] for stream in streams] == ["r0", "r1", "r2"]


def test_aborting_one_request_of_a_stream(processor):
    aborted: list[list[int]] = []
    stream = OutputStream([3, 4], on_close=aborted.append)
    for rid in (3, 4):
        processor.register(stream, rid, tokenizer=BYTES, prompt_ids=[])
    processor.put([TokenEvent(4, ids_of("done"), LENGTH)])
    processor.pump()
    stream.abort(4)  # finished: nothing to abort
    stream.abort(3)
    assert aborted == [[3]]
    with pytest.raises(ValueError, match="not one of"):
        stream.abort(5)
    processor.put([TokenEvent(3, [], {"type": "abort", "message": "interrupted"})])
    processor.pump()
    assert [r["meta_info"]["finish_reason"]["type"] for r in stream.results()] == ["abort",
                                                                                   "length"]


def test_registering_after_close_fails_the_streams():
    processor = OutputProcessor()
    processor.close()
    stream = OutputStream([0])
    processor.register_many([processor.registration(stream, 0, tokenizer=BYTES,
                                                    prompt_ids=[])])
    with pytest.raises(RuntimeError, match="closed"):
        stream.get(timeout=0)
