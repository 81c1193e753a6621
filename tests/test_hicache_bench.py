"""bench/hicache.py's multi-turn driver (SGLang's bench_multiturn shape) against a fake runtime:
every client runs its rounds, each request is its conversation so far plus a new turn, at most
`max_parallel` requests are in flight (and that many are, while clients wait), and the pool is
the conversations' final length over `over_pool`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from bench.hicache import Tokens, Workload, drive, per_round

ANSWER_TOKEN = 7


class FakeRuntime:
    """Streams `max_new_tokens` chunks of one token each; a prompt's cached tokens are the
    longest earlier prompt plus answer it starts with."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.answered: list[list[int]] = []
        self.in_flight = self.peak = 0

    def generate(self, *, input_ids: list[int], sampling_params: dict[str, Any],
                 stream: bool) -> AsyncIterator[dict[str, Any]]:
        assert stream and sampling_params["ignore_eos"]
        self.prompts.append(list(input_ids))
        return self._stream(list(input_ids), sampling_params["max_new_tokens"])

    async def _stream(self, ids: list[int], n: int) -> AsyncIterator[dict[str, Any]]:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        cached = max((len(done) for done in self.answered if ids[:len(done)] == done), default=0)
        for _ in range(n):
            await asyncio.sleep(0)
            yield {"output_ids": [ANSWER_TOKEN], "meta_info": {"cached_tokens": cached}}
        self.in_flight -= 1
        self.answered.append(ids + [ANSWER_TOKEN] * n)


def test_multi_turn_driver_runs_sglang_bench_multiturn_shape() -> None:
    workload = Workload(clients=6, rounds=3, request_length=20, output_length=2, max_parallel=4,
                        sub_question_length=5)
    assert workload.conversation_tokens == 20 + 2 * 5 + 3 * 2
    assert workload.pool == 6 * 36 // 4
    rt = FakeRuntime()
    turns = asyncio.run(drive(rt, workload, Tokens(5000), seed=3))
    assert len(turns) == 6 * 3 and rt.peak == 4
    by_client: dict[int, list[int]] = {}
    for turn in turns:
        by_client.setdefault(turn.client, []).append(turn.round)
        assert turn.prompt_tokens == 20 + turn.round * (2 + 5)
        assert turn.output_tokens == 2 and turn.ttft <= turn.latency
        assert turn.cached_tokens == (0 if turn.round == 0 else turn.prompt_tokens - 5)
    assert all(rounds == [0, 1, 2] for rounds in by_client.values())
    later = [p for p in rt.prompts if len(p) > 20]
    assert all(any(p[:len(done)] == done for done in rt.answered) for p in later)
    rows = per_round(turns)
    assert [row["round"] for row in rows] == [0, 1, 2] and rows[0]["hit_share"] == 0
    assert rows[2]["hit_share"] == (34 - 5) / 34
