"""`/generate`'s streamed meta_info (`server/streamed_meta.py`), the output lists rebuilt from
running chunks (`runtime/output/logprob_lists.OutputLists`) and the running form a replica's
events are turned back into (`logprob_lists.running_form`)."""

from __future__ import annotations

from lmnb.runtime.output.logprob_lists import OutputLists, running_form
from lmnb.server.streamed_meta import StreamedMeta

PROMPT = [(None, 1), (-0.5, 2)]


def test_running_chunks_build_the_lists_so_far():
    meta = StreamedMeta("v1")
    first = meta.add({"finish_reason": None, "input_token_logprobs": PROMPT, "cached_tokens": 1,
                      "output_ids_from": 0, "new_token_logprobs": [(-0.1, 5)]})
    second = meta.add({"finish_reason": None, "output_ids_from": 1,
                       "new_token_logprobs": [(-0.2, 6)]})
    assert first["output_token_logprobs"] == [(-0.1, 5)] and first["cached_tokens"] == 1
    assert second["input_token_logprobs"] == PROMPT
    assert second["output_token_logprobs"] == [(-0.1, 5), (-0.2, 6)]
    assert second["output_token_logprobs_length"] == 2 and second["weight_version"] == "v1"
    assert "new_token_logprobs" not in second and "output_ids_from" not in second


def test_output_lists_put_each_chunks_rows_at_its_position():
    """Several new rows at once (a jump-forward's) replace the tail from `output_ids_from`;
    a list the chunks never brought (no top logprobs asked) stays absent; a last chunk's
    whole lists replace the rows so far."""
    lists = OutputLists()
    lists.add({"output_ids_from": 0, "new_token_logprobs": [(-0.1, 5)]})
    lists.add({"output_ids_from": 1, "new_token_logprobs": [(-0.2, 6)]})
    lists.add({"output_ids_from": 1, "new_token_logprobs": [(None, 7), (None, 8)]})
    assert lists.rows("output_token_logprobs") == [(-0.1, 5), (None, 7), (None, 8)]
    assert lists.rows("output_token_logprobs", 2) == [(None, 8)]
    assert not lists.has("output_top_logprobs") and lists.rows("output_top_logprobs") == []
    lists.add({"output_token_logprobs": [(-0.1, 5)], "output_top_logprobs": [[(-0.1, 5)]]})
    assert lists.rows("output_token_logprobs") == [(-0.1, 5)]
    assert lists.rows("output_top_logprobs") == [[(-0.1, 5)]]


def test_events_with_whole_lists_keep_them():
    """A runtime whose running chunks carry the output's list whole so far (not `new_*` rows)
    keeps it: the events report it, not an empty list."""
    meta = StreamedMeta("v1")
    event = meta.add({"finish_reason": None, "input_token_logprobs": PROMPT,
                      "output_token_logprobs": [(-0.1, 5), (-0.2, 6)]})
    assert event["output_token_logprobs"] == [(-0.1, 5), (-0.2, 6)]
    assert event["output_token_logprobs_length"] == 2


def test_running_form_gives_the_new_rows_and_the_prompt_once():
    whole = {"finish_reason": None, "input_token_logprobs": PROMPT, "cached_tokens": 1,
             "output_token_logprobs": [(-0.1, 5), (-0.2, 6)],
             "output_top_logprobs": [[(-0.1, 5)], [(-0.2, 6)]],
             "output_token_logprobs_length": 2}
    first = running_form(whole, 0, with_prompt=True)
    assert first["output_ids_from"] == 0
    assert first["new_token_logprobs"] == [(-0.1, 5), (-0.2, 6)]
    assert first["new_top_logprobs"] == [[(-0.1, 5)], [(-0.2, 6)]]
    assert first["input_token_logprobs"] == PROMPT and first["cached_tokens"] == 1
    assert not {"output_token_logprobs", "output_top_logprobs",
                "output_token_logprobs_length"} & first.keys()
    later = running_form({**whole, "output_token_logprobs": [(-0.1, 5), (-0.2, 6), (-0.3, 7)],
                          "output_top_logprobs": [[], [], [(-0.3, 7)]]}, 2, with_prompt=False)
    assert later["output_ids_from"] == 2
    assert later["new_token_logprobs"] == [(-0.3, 7)] and later["new_top_logprobs"] == [[(-0.3, 7)]]
    assert "input_token_logprobs" not in later
