"""The media of a generate call, prompt by prompt: the items loaded from `image_data` /
`video_data`, and each prompt's ids with every image/video token replaced by its item's span of
pad ids (`MediaProcessor.expand`). Runs on the caller's thread, before anything is submitted."""

from __future__ import annotations

from typing import Any

from lmnb.multimodal.items import MediaItem, MultimodalInputs, pad_token_id
from lmnb.multimodal.processor import MediaProcessor
from lmnb.runtime.core import InvalidRequestError
from lmnb.runtime.prompts import ids_in_range

# One prompt: an image (path, PIL image, array, bytes, data: URL, MediaItem) or a list of them;
# a list of prompts: a list of those (None for a prompt without media).
MediaInput = Any

MediaPrompt = tuple[list[int], MultimodalInputs | None]  # expanded ids, their media (None: none)


def build_media_prompts(processor: MediaProcessor | None, token_lists: list[list[int]],
                        image_data: MediaInput, video_data: MediaInput, *, is_batch: bool,
                        vocab_size: int, model_name: str) -> list[MediaPrompt]:
    """Per prompt of `token_lists`, its ids expanded by its media and the media items (images,
    then videos; each kind in prompt order). `model_name` names a text model (no `processor`)
    that was given media."""
    media = _media_lists(processor, image_data, video_data, len(token_lists), is_batch,
                         model_name)
    return [_expand(processor, ids, items, vocab_size)
            for ids, items in zip(token_lists, media, strict=True)]


def check_prompt_ids(ids: list[int], mm_inputs: MultimodalInputs | None, vocab_size: int) -> None:
    """Text ids in [0, vocab_size); pad ids (>= vocab_size) only inside media spans."""
    if mm_inputs is not None:
        ids = list(ids)
        for item in mm_inputs.items:
            span = ids[item.offset:item.end]
            if item.offset < 0 or span != [pad_token_id(item.hash, vocab_size)] * item.num_tokens:
                raise InvalidRequestError(f"a {item.kind} span is not where its item says")
            ids[item.offset:item.end] = [0] * item.num_tokens
    if not ids_in_range(ids, vocab_size):
        raise InvalidRequestError(f"input_ids must be ints in [0, {vocab_size})")


def _media_lists(processor: MediaProcessor | None, image_data: MediaInput,
                 video_data: MediaInput, count: int, is_batch: bool,
                 model_name: str) -> list[list[MediaItem]]:
    """Per prompt its media items (images, then videos; each kind in prompt order),
    loaded and preprocessed here, on the caller's thread."""
    if image_data is None and video_data is None:
        return [[] for _ in range(count)]
    if processor is None:
        raise InvalidRequestError(f"{model_name} is a text model: it takes no image_data or "
                                  "video_data")
    per_prompt: list[list[MediaItem]] = [[] for _ in range(count)]
    for kind, data in (("image", image_data), ("video", video_data)):
        if data is None:
            continue
        if is_batch and not isinstance(data, list | tuple):
            groups = [data] * count  # one item for every prompt, as SGLang's
        elif is_batch:
            if len(data) != count:
                raise InvalidRequestError(
                    f"{kind}_data for a list of {count} prompts must be one {kind} for all "
                    f"or a list of {count} entries (an {kind}, a list of them, or None per "
                    "prompt)")
            groups = list(data)
        else:
            groups = [data]
        for items, group in zip(per_prompt, groups, strict=True):
            if group is None:
                continue
            sources = list(group) if isinstance(group, list | tuple) else [group]
            items.extend(processor.item(kind, source) for source in sources)
    return per_prompt


def _expand(processor: MediaProcessor | None, ids: list[int], items: list[MediaItem],
            vocab_size: int) -> MediaPrompt:
    """The prompt with each image/video token replaced by its item's span of pad ids."""
    if processor is None:
        return ids, None
    media_tokens = {processor.image_token_id, processor.video_token_id} - {None}
    if not items and not any(t in media_tokens for t in ids):
        return ids, None
    check_prompt_ids(ids, None, vocab_size)
    expanded = processor.expand(ids, items)
    return expanded, MultimodalInputs(sorted(items, key=lambda item: item.offset))
