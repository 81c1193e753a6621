"""Output side of the runtime, off the scheduler's critical path: the scheduler puts one list of
`TokenEvent`s per step; the `OutputProcessor` thread detokenizes and delivers chunks to
`OutputStream`s, which a thread or an asyncio task consumes."""

from lmnb.runtime.output.detokenizer import Decoder, IncrementalDetokenizer, prompt_tail
from lmnb.runtime.output.events import TokenEvent
from lmnb.runtime.output.processor import OutputProcessor
from lmnb.runtime.output.stop import first_stop_regex_match
from lmnb.runtime.output.stream import Chunk, OutputStream

__all__ = ["Chunk", "Decoder", "IncrementalDetokenizer", "OutputProcessor", "OutputStream",
           "TokenEvent", "first_stop_regex_match", "prompt_tail"]
