"""`TurnTokens`: the prompts that one turn of the program loop asks to encode, tokenized together
at the turn's end.

A `run_batch`'s programs reach their first gens in one turn of the loop; encoded one by one,
each prompt's new text (the question after a shared few-shot prefix) took a call of the
tokenizer that holds the GIL (~30 us on the CPU box, ~36 us on the H100's host). Gathered, they
are one `PromptTokens.encode_many`: one batch call, which releases the GIL and spreads the texts
over the cores. Each gen waits one turn more for its ids; the gens then submit in the next turn,
together as before (`submit_chunks`).
"""

from __future__ import annotations

import asyncio

from lmnb.lang.event_loop import on_program_loop
from lmnb.lang.prompt_tokens import PromptTokens


class TurnTokens:
    """`await encode(text)`: `tokens.encode(text)`, batched per turn of the program loop (on
    another event loop, encoded at once)."""

    def __init__(self, tokens: PromptTokens) -> None:
        self.tokens = tokens
        self._texts: list[str] = []
        self._waiting: list[asyncio.Future[list[int]]] = []

    async def encode(self, text: str) -> list[int]:
        if not on_program_loop():
            return self.tokens.encode(text)
        loop = asyncio.get_running_loop()
        if not self._texts:
            loop.call_soon(self._encode_turn)
        future: asyncio.Future[list[int]] = loop.create_future()
        self._texts.append(text)
        self._waiting.append(future)
        return await future

    def _encode_turn(self) -> None:
        texts, waiting = self._texts, self._waiting
        self._texts, self._waiting = [], []
        try:
            encoded = self.tokens.encode_many(texts)
        except Exception as error:  # each gen fails with it
            for future in waiting:
                if not future.done():
                    future.set_exception(error)
            return
        for future, ids in zip(waiting, encoded, strict=True):
            if not future.done():  # its task was cancelled meanwhile
                future.set_result(ids)
