"""`EngineSurface`: what the frontends (the server, the DSL's local backend, the magics, the
widgets) use of a runtime. `Runtime` and `DataParallelRuntime` both implement it; the server's
`ServedRuntime` is this protocol, and the widgets' `PolledRuntime` (`closed`, `failed`) a part of
it. Extras of one runtime alone (`Runtime.pin_prefix`, `media_snapshot`, `cache_events`;
`DataParallelRuntime.use_router`) are not in it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lmnb.multimodal.processor import MediaProcessor
from lmnb.runtime.config import EngineConfig, ModelConfig
from lmnb.runtime.media_requests import MediaInput
from lmnb.runtime.output import OutputStream
from lmnb.runtime.prompts import IdsInput, PromptInput
from lmnb.runtime.request_checks import (
    LogprobCountInput,
    LogprobFlagInput,
    SamplingInput,
    TokenIdsInput,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GenerateResult = dict[str, Any] | list[dict[str, Any]] | OutputStream


@runtime_checkable
class EngineSurface(Protocol):
    """A runtime as its frontends see it (`isinstance` checks that the names exist)."""

    tokenizer: PreTrainedTokenizerBase
    model_config: ModelConfig
    engine_config: EngineConfig
    model_dir: Path
    context_len: int  # a prompt plus its output stays below it
    max_total_tokens: int  # KV pool size (summed over data-parallel replicas)
    media_processor: MediaProcessor | None  # None: the runtime takes no images or videos

    @property
    def closed(self) -> bool: ...

    @property
    def failed(self) -> bool:
        """Broken for good: every later call raises (create a new runtime)."""
        ...

    @property
    def image_token(self) -> str | None:
        """The prompt text that stands for one image (None: it takes no images)."""
        ...

    @property
    def video_token(self) -> str | None:
        """The prompt text that stands for one video (None: it takes no videos)."""
        ...

    def generate(self, prompt: PromptInput = None, sampling_params: SamplingInput = None, *,
                 input_ids: IdsInput = None, image_data: MediaInput = None,
                 video_data: MediaInput = None, return_logprob: LogprobFlagInput = False,
                 logprob_start_len: LogprobCountInput = None,
                 top_logprobs_num: LogprobCountInput = None,
                 token_ids_logprob: TokenIdsInput = None, return_text_in_logprobs: bool = False,
                 stream: bool = False, return_token_origins: bool = False,
                 incremental: bool = True) -> GenerateResult:
        """A dict for one prompt, a list for a list (n per prompt), an `OutputStream` with
        `stream=True` (of one whole dict per request with `incremental=False`; see
        `Runtime.generate`)."""
        ...

    def batched_submits(self) -> AbstractContextManager[None]:
        """A block in which this thread's streamed `generate` calls are sent together at its end
        (see `Runtime.batched_submits`)."""
        ...

    def cache_prefix(self, prompt: str | None = None, *,
                     input_ids: Sequence[int] | None = None) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str: ...

    def get_tokenizer(self) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def flush_cache(self) -> bool: ...

    def cache_snapshot(self, preview_tokens: int = 16) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...

    def shutdown(self) -> None: ...
