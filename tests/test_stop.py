"""The one stop module (`lmnb.runtime.output.stop`): its rules on their own, and the scheduler's
watcher (`StopText`), the output processor, the OpenAI backend's client-side cut and API
speculation agreeing with them. No model, no tokenizer files: ids are bytes."""

from __future__ import annotations

from lmnb.lang.backends.openai import _cut, _Reply
from lmnb.lang.ir import GenParams
from lmnb.lang.speculation import Speculation
from lmnb.params import SamplingParams
from lmnb.runtime.output import OutputProcessor, OutputStream, TokenEvent
from lmnb.runtime.output.stop import (
    StopRules,
    StopStrings,
    by_length,
    compile_stop_regex,
    first_stop_regex_match,
    stopped_on_token,
)
from lmnb.runtime.output.stop_text import StopText

EOS = 256


class Bytes:
    """Ids 0-255 are bytes; 256 is EOS (a special token)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(b"" if i == EOS else bytes([i]) for i in ids)
        return data.decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def output_text(pieces: list[list[int]], reason: dict, **rules: list[str]) -> tuple[str, str]:
    """(streamed text, final text) of one request fed `pieces` one step each."""
    processor = OutputProcessor()
    streamed, final = OutputStream([0], incremental=True), OutputStream([1], incremental=False)
    for rid, stream in ((0, streamed), (1, final)):
        processor.register(stream, rid, tokenizer=Bytes(), prompt_ids=[], **rules)
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        processor.put([TokenEvent(rid, list(piece), reason if last else None) for rid in (0, 1)])
    processor.pump()
    processor.close()
    chunks = []
    while (chunk := streamed.get(timeout=0)) is not None:
        chunks.append(chunk["text"])
    return "".join(chunks), final.results()[0]["text"]


def watch(pieces: list[list[int]], params: SamplingParams) -> tuple[int, str | None]:
    """(step, match) where the scheduler's watcher sees a text rule fire."""
    watcher = StopText(Bytes(), [], params)
    for step, piece in enumerate(pieces, 1):
        watcher.add(piece)
        if watcher.matched is not None:
            return step, watcher.matched
    return len(pieces), None


def test_stop_strings_rules():
    stops = StopStrings.of(["END", "", "END", "abcdef", "cd"])
    assert stops.strings == ("END", "abcdef", "cd")  # empty dropped, duplicates once
    assert stops.first("xxabcdefEND") == (4, "cd")  # completes first, though it starts later
    assert stops.first("no stop here") is None
    assert (stops.held("text E"), stops.held("text EN"), stops.held("text abcde"),
            stops.held("text Q")) == (1, 2, 5, 0)
    assert not StopStrings.of(None) and StopStrings.of(None).held("abc") == 0


def test_a_stop_string_split_across_tokens_never_streams():
    pieces = [ids_of("hello E"), ids_of("N"), ids_of("D and more")]
    params = SamplingParams(stop=["END"])
    assert watch(pieces, params) == (3, "END")
    reason = {"type": "stop", "matched": "END"}
    # "E" and "EN" were held back while they could begin the stop; the stop is never shown.
    assert output_text(pieces, reason, stop=["END"]) == ("hello ", "hello ")
    # A held tail that turns out not to be a stop is released.
    assert output_text([ids_of("EN"), ids_of("X")], {"type": "length", "length": 3},
                       stop=["END"]) == ("ENX", "ENX")


def test_regex_stop_matches_across_tokens_and_cuts_at_the_match():
    pieces = [ids_of("order 1"), ids_of("2"), ids_of("3 shipped")]
    params = SamplingParams(stop_regex=[r"\d{3}", "shipped"])
    assert watch(pieces, params) == (3, "123")
    patterns = compile_stop_regex(params.stop_regex)
    assert first_stop_regex_match(patterns, "123 shipped").group() == "123"
    assert first_stop_regex_match(patterns, "shipped 123").group() == "shipped"
    assert first_stop_regex_match(patterns, "12 shipped", start=3).group() == "shipped"
    # Text streamed before the match completed stays streamed; the final text ends at the match.
    streamed, final = output_text(pieces, {"type": "stop", "matched": "123"},
                                  stop_regex=params.stop_regex)
    assert final == "order " and streamed.startswith("order ") and "3" not in streamed
    # The OpenAI backend applies the same cut to what an endpoint streams.
    reply = _Reply(text="order 123 shipped")
    assert _cut(reply, patterns) and (reply.text, reply.matched) == ("order ", "123")


def test_stops_are_not_included_in_the_text():
    reason = {"type": "stop", "matched": EOS}
    assert stopped_on_token(reason, [5, EOS])
    assert not stopped_on_token(reason, [EOS, 5])
    assert not stopped_on_token({"type": "stop", "matched": True}, [1])  # a bool is no id
    assert not stopped_on_token({"type": "stop", "matched": "x"}, [120])
    assert output_text([ids_of("ok"), [EOS]], reason) == ("ok", "ok")
    assert output_text([ids_of("ok then STOP more")], {"type": "stop", "matched": "STOP"},
                       stop=["STOP"]) == ("ok then ", "ok then ")


def test_min_new_tokens_holds_back_token_stops_but_not_text_stops():
    rules = StopRules({EOS})
    params = SamplingParams(min_new_tokens=2, stop_token_ids=[7], max_new_tokens=4,
                            stop=["x"])
    for token in (EOS, 7):
        assert rules.by_token(token, params, output_len=2) is None
        assert rules.by_token(token, params, output_len=3) == {"type": "stop",
                                                                "matched": token}
    assert rules.by_token(EOS, SamplingParams(ignore_eos=True), output_len=5) is None
    # Stop strings (and regexes) end the output from the first token on, as in SGLang.
    watcher = StopText(Bytes(), [], params)
    watcher.add(ids_of("x"))
    assert rules.after_text(watcher, None, params, output_len=1) == {"type": "stop",
                                                                     "matched": "x"}
    assert rules.after_text(None, None, params, output_len=4) == {"type": "length",
                                                                  "length": 4}
    assert by_length(params, 3) is None
    assert rules.by_token_or_length(5, params, output_len=4)["type"] == "length"


def test_speculation_cuts_where_a_real_call_stops():
    """The speculated text is cut at the stop that completes first, as the runtime's stop rule
    ends a real call (not at the one that starts first)."""
    params = GenParams(stop=("abcdef", "cd"), max_new_tokens=50, temperature=0.0)
    speculation = Speculation.from_call(
        "xxabcdefyy", {"completion_tokens": 10, "finish_reason": {"type": "length"}},
        params, role=None)
    served = speculation.serve(params)
    assert served is not None and served.text == "xxab"
    assert served.meta_info["finish_reason"] == {"type": "stop", "matched": "cd"}
    assert served.rest.text == "cdefyy"
    assert not speculation.runs_out(params)
    assert speculation.runs_out(GenParams(stop=("zz",), max_new_tokens=50, temperature=0.0))


def test_a_stop_regex_match_in_text_held_for_a_stop_string_ends_the_output_at_once():
    # "b" may begin the stop string "bc", so the detokenizer holds it back; the regex "ab"
    # has matched all the same and ends the request at this token, not one token later.
    params = SamplingParams(stop=["bc"], stop_regex=["ab"])
    assert watch([ids_of("xab"), ids_of("d")], params) == (1, "ab")
    assert output_text([ids_of("xab")], {"type": "stop", "matched": "ab"}, stop=["bc"],
                       stop_regex=["ab"]) == ("x", "x")
