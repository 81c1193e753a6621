"""Images and videos for LLaVA programs: loading, content hashing, preprocessing, and the plain
data (`MediaItem`, `MultimodalInputs`) a request carries to the model runner."""

from lmnb.multimodal.items import MediaItem, MultimodalInputs, pad_token_id
