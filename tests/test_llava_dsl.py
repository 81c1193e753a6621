"""LLaVA programs in the DSL: `image()` / `video()` inside roles with gen, select, fork and
run_batch; the backends pass the media in prompt order; the media widget.

The first part runs on a recording fake backend (the interpreter's plumbing); the rest on the tiny
random-weight LLaVA of `tests/llava_fixtures.py` (fp32, CPU, SmolLM2's tokenizer)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import lmnb
from lmnb import assistant, gen, image, select, user, video
from lmnb.lang.backends.base import Generation, MediaInput, MediaUnsupported
from lmnb.lang.chat_template import ChatTemplate
from lmnb.lang.interpreter import ProgramError
from lmnb.lang.ir import GenParams


# ---- the interpreter's plumbing, on a recording backend -----------------------------------------
class FakeMediaBackend:
    """Answers every gen with "ok", records each call's prompt and media."""

    def __init__(self, *, kinds: tuple[str, ...] = ("image", "video")) -> None:
        self.chat_template = ChatTemplate(None)
        self.kinds = kinds
        self.calls: list[tuple[str, str, tuple[MediaInput, ...]]] = []
        self.prepared: list[tuple[str, Any, int | None]] = []
        self._lock = threading.Lock()

    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        if kind not in self.kinds:
            raise MediaUnsupported(f"this model takes no {kind}s")
        if source == "missing.png":
            raise ValueError("image file not found: missing.png")
        with self._lock:
            self.prepared.append((kind, source, num_frames))
        return MediaInput(kind, f"<{kind}>", (source, num_frames), label=str(source))

    def _record(self, call: str, prompt: str, media: tuple[MediaInput, ...]) -> None:
        with self._lock:
            self.calls.append((call, prompt, tuple(media)))

    def generate(self, prompt: str, params: GenParams, *,
                 on_delta: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None,
                 media: tuple[MediaInput, ...] = ()) -> Generation:
        self._record("gen", prompt, media)
        return Generation("ok", {"finish_reason": {"type": "stop"}})

    def select(self, prompt: str, choices: tuple[str, ...], method: str, *,
               media: tuple[MediaInput, ...] = ()) -> tuple[str, dict]:
        self._record("select", prompt, media)
        return choices[-1], {}

    def cache_prefix(self, prompt: str, *, media: tuple[MediaInput, ...] = ()) -> None:
        self._record("cache", prompt, media)


class TextOnlyBackend(FakeMediaBackend):
    prepare_media = None  # type: ignore[assignment]


def sources(media: tuple[MediaInput, ...]) -> list[Any]:
    return [m.data[0] for m in media]


@lmnb.function
def describe(s, picture, clip):
    s += user(image(picture) + "What is it?" + video(clip, num_frames=4) + "And this?")
    s += assistant(gen("answer", max_tokens=4))


def test_media_go_to_the_backend_in_prompt_order():
    backend = FakeMediaBackend()
    state = describe.run(picture="cat.png", clip="bunny.mp4", backend=backend)
    ((call, prompt, media),) = backend.calls
    assert call == "gen"
    assert prompt == "User: <image>What is it?<video>And this?\nAssistant: "
    assert [m.kind for m in media] == ["image", "video"]
    assert sources(media) == ["cat.png", "bunny.mp4"]
    assert backend.prepared == [("image", "cat.png", None), ("video", "bunny.mp4", 4)]
    # the placeholders stay in the state's text and messages
    assert state.text().startswith("User: <image>What is it?<video>And this?")
    assert state.messages()[0] == {"role": "user",
                                   "content": "<image>What is it?<video>And this?"}
    assert state["answer"] == "ok"


def test_text_only_calls_get_no_media_argument():
    backend = FakeMediaBackend()

    @lmnb.function
    def plain(s):
        s += user("Hi") + assistant(gen("a", max_tokens=2))

    plain.run(backend=backend)
    assert backend.calls[0][2] == ()


@lmnb.function
def several_questions(s, picture, questions):
    s += user(image(picture) + "Look at the picture.")
    forks = s.fork(len(questions))
    forks += [user(q) + assistant(gen("answer", max_tokens=4)) for q in questions]
    forks += lambda i: user("Is it a cat?") + assistant(select("cat", choices=["yes", "no"]))
    forks.join()


def test_fork_branches_share_the_prepared_image():
    backend = FakeMediaBackend()
    state = several_questions.run(picture="cat.png", questions=["Q1?", "Q2?", "Q3?"],
                                  backend=backend)
    assert backend.prepared == [("image", "cat.png", None)]  # loaded once for all branches
    (cache,) = [c for c in backend.calls if c[0] == "cache"]
    assert cache[1] == "User: <image>Look at the picture.\n" and sources(cache[2]) == ["cat.png"]
    gens = [c for c in backend.calls if c[0] == "gen"]
    selects = [c for c in backend.calls if c[0] == "select"]
    assert len(gens) == len(selects) == 3
    first = gens[0][2][0]
    for _, prompt, media in gens + selects:
        assert prompt.startswith("User: <image>Look at the picture.")
        assert len(media) == 1 and media[0] is first  # one item: one hash, one KV span
    assert state["answer"] == ["ok"] * 3 and state["cat"] == ["no"] * 3


def test_concat_join_carries_branch_media_along():
    backend = FakeMediaBackend()

    @lmnb.function
    def compare(s):
        s += "Two pictures:"
        forks = s.fork(2)
        forks += lambda i: image(f"p{i}.png") + f" picture {i}."
        forks.join("concat_and_append")
        s += image("p2.png") + " Which is best?" + gen("best", max_tokens=2)

    state = compare.run(backend=backend)
    ((_, prompt, media),) = [c for c in backend.calls if c[0] == "gen"]
    assert prompt == "Two pictures:<image> picture 0.<image> picture 1.<image> Which is best?"
    assert sources(media) == ["p0.png", "p1.png", "p2.png"]
    assert state.text().count("<image>") == 3


def test_media_errors_are_clear():
    def error_of(backend: Any, picture: str = "cat.png") -> str:
        state = describe.run(picture=picture, clip="x.mp4", backend=backend)
        with pytest.raises(ProgramError) as raised:
            state.text()
        return str(raised.value)

    assert "image() needs a multimodal (LLaVA) backend: TextOnlyBackend is text-only" in \
        error_of(TextOnlyBackend())
    assert "video() needs a multimodal (LLaVA) backend: this model takes no videos" in \
        error_of(FakeMediaBackend(kinds=("image",)))
    assert "image file not found: missing.png" in error_of(FakeMediaBackend(), "missing.png")


def test_run_batch_over_images_caches_only_the_text_before_the_image():
    backend = FakeMediaBackend()

    @lmnb.function
    def caption(s, picture):
        s += "You describe pictures.\n" + image(picture) + "Caption:" + gen("c", max_tokens=3)

    states = caption.run_batch([{"picture": p} for p in ("a.png", "b.png", "c.png")],
                               backend=backend)
    assert [s["c"] for s in states] == ["ok"] * 3
    caches = [c for c in backend.calls if c[0] == "cache"]
    assert caches == [("cache", "You describe pictures.\n", ())]
    gens = sorted((c for c in backend.calls if c[0] == "gen"), key=lambda c: sources(c[2]))
    assert [sources(c[2]) for c in gens] == [["a.png"], ["b.png"], ["c.png"]]


LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def test_chat_template_of_content_parts_and_its_image_text(smollm2_dir):
    """llava-hf's templates read content parts only and write "<image>\\n" for an image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = LLAVA_15_TEMPLATE
    template = ChatTemplate(tokenizer)
    assert template.role_text("user", first=True).prefix == "USER: "
    assert template.role_text("assistant", first=False).prefix == "ASSISTANT: "
    assert template.media_text("image", "<image>") == "<image>\n"
    assert template.media_text("video", "<video>") == "<video>"  # the template writes none
    chatml = ChatTemplate(AutoTokenizer.from_pretrained(smollm2_dir))  # string content
    assert chatml.media_text("image", "<image>") == "<image>"

    backend = FakeMediaBackend()
    backend.chat_template = template
    describe.run(picture="cat.png", clip="bunny.mp4", backend=backend)
    assert backend.calls[0][1] == "USER: <image>\nWhat is it?<video>And this? ASSISTANT: "
