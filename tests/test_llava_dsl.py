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

    is_chat_model = False
    reports_token_texts = False

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
        return MediaInput(kind, f"<{kind}>", (source, num_frames))

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
    def prepare_media(self, kind: str, source: Any, *,
                      num_frames: int | None = None) -> MediaInput:
        raise MediaUnsupported(f"{type(self).__name__} is text-only")


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


def test_compiled_program_passes_media_too():
    @lmnb.function
    def describe_twice(s, picture):
        s += user(image(picture) + "What is it?")
        forks = s.fork(2)
        forks += assistant(gen("answer", max_tokens=4))
        forks.join()

    assert "image {picture}" in str(describe_twice.trace())
    backend = FakeMediaBackend()
    state = describe_twice.compile().run(picture="cat.png", backend=backend)
    assert state["answer"] == ["ok", "ok"]
    assert backend.prepared == [("image", "cat.png", None)]
    assert [(c[0], sources(c[2])) for c in backend.calls] == [
        ("cache", ["cat.png"]), ("gen", ["cat.png"]), ("gen", ["cat.png"])]


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


# ---- on a tiny LLaVA (fp32, CPU) -----------------------------------------------------------------
GREEDY = {"temperature": 0.0}


def picture(seed: int, size: tuple[int, int] = (40, 52)) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def llava(tiny_llavas):
    with lmnb.Runtime(tiny_llavas["llava-1.5"], max_total_tokens=8192,
                      check_integrity_each_step=True) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def llava_video(tiny_llavas):
    with lmnb.Runtime(tiny_llavas["llava-next-video"], max_total_tokens=8192) as runtime:
        yield runtime


def image_item(runtime: Any, source: Any) -> Any:
    return runtime.media_processor.image(source)


@lmnb.function
def ask_many(s, pic, questions):
    s += user(image(pic) + "Look at this picture.")
    forks = s.fork(len(questions))
    forks += [user(q) + assistant(gen("answer", max_tokens=4)) for q in questions]
    forks.join()
    return forks


def test_fork_branches_hit_the_image_span(llava):
    assert llava.flush_cache()
    pic = picture(1)
    item = image_item(llava, pic)
    state = ask_many.run(pic=pic, questions=["What is it?", "Which color?", "Where?"],
                         backend=llava, **GREEDY)
    forks = state.ret_value
    prefix = "<|im_start|>user\n<image>\nLook at this picture.<|im_end|>\n"
    assert state.text() == prefix  # the placeholder stays in the text (the template's form)
    assert state.messages() == [{"role": "user", "content": "<image>\nLook at this picture."}]
    prefix_tokens = len(llava.encode(prefix)) - 1 + item.num_tokens  # <image> -> its span
    for fork in forks:
        meta = fork.get_meta_info("answer")
        # The fork cached the prefix first: every branch finds the image span and the text
        # around it cached.
        assert meta["cached_tokens"] >= prefix_tokens
        assert meta["prompt_tokens"] > prefix_tokens
    # Same program again: the same image (another array object, same pixels) hits again.
    again = ask_many.run(pic=pic.copy(), questions=["What is it?"], backend=llava, **GREEDY)
    assert again.ret_value[0]["answer"] == forks[0]["answer"]  # greedy: the same answer
    (row,) = [r for r in llava.media_snapshot() if r["hash"] == f"{item.hash:016x}"]
    assert row["kind"] == "image" and row["num_tokens"] == item.num_tokens
    assert row["resident"] and row["hits"] >= 4 and row["requests"] >= 5
    stats = llava.stats()
    assert stats["cached_media_tokens"] >= 4 * item.num_tokens
    llava.check_integrity()


@lmnb.function
def caption(s, pic):
    s += user("Describe the picture." + image(pic))
    s += assistant(gen("caption", max_tokens=5))


def test_run_batch_over_images(llava):
    assert llava.flush_cache()
    pics = [picture(10 + i) for i in range(3)]
    states = caption.run_batch([{"pic": p} for p in pics], backend=llava, **GREEDY)
    metas = [s.get_meta_info("caption") for s in states]
    hashes = {f"{image_item(llava, p).hash:016x}" for p in pics}
    assert len(hashes) == 3
    snapshot = {r["hash"]: r for r in llava.media_snapshot()}
    assert hashes <= set(snapshot)
    # Alone, each program's caption is the same (batching does not change greedy results).
    alone = caption.run(pic=pics[1], backend=llava, **GREEDY)
    assert alone["caption"] == states[1]["caption"]
    assert alone.get_meta_info("caption")["cached_tokens"] >= metas[1]["prompt_tokens"] - 1
    # Different images of the same size share only the text before them.
    before = len(llava.encode("<|im_start|>user\nDescribe the picture."))
    for meta in metas:
        assert meta["cached_tokens"] <= before
    llava.check_integrity()


def test_select_after_an_image_scores_past_the_span(llava):
    pic = picture(3)
    prompt = "<|im_start|>user\n<image>\nIs this a cat?<|im_end|>\n<|im_start|>assistant\n"

    @lmnb.function
    def is_cat(s, pic):
        s += user(image(pic) + "Is this a cat?")
        s += assistant(select("verdict", choices=["yes", "no", "maybe not"]))

    state = is_cat.run(pic=pic, backend=llava)
    meta = state.get_meta_info("verdict")
    # The same scores from whole requests: each choice's tokens' logprobs after the prompt.
    scored_from = meta["scored_from"]  # in the unexpanded ids
    for choice, logprobs in zip(["yes", "no", "maybe not"], meta["input_token_logprobs"],
                                strict=True):
        ids = llava.encode(prompt + choice)
        out = llava.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                             image_data=[pic], return_logprob=True, logprob_start_len=0)
        pairs = out["meta_info"]["input_token_logprobs"][-(len(ids) - scored_from):]
        assert [t for _, t in pairs] == ids[scored_from:]
        assert [lp for lp, _ in pairs] == pytest.approx([lp for lp, *_ in logprobs], abs=1e-4)
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert state["verdict"] == ["yes", "no", "maybe not"][best]


def test_video_and_images_in_one_program(llava_video):
    import numpy as np

    rng = np.random.default_rng(0)
    clip = rng.integers(0, 256, size=(12, 32, 40, 3), dtype=np.uint8)

    @lmnb.function
    def watch(s, clip, pic):
        s += user(video(clip, num_frames=4) + "and" + image(pic) + "Same scene?")
        s += assistant(gen("answer", max_tokens=3))

    first = watch.run(clip=clip, pic=picture(5, (24, 24)), backend=llava_video, **GREEDY)
    second = watch.run(clip=clip, pic=picture(5, (24, 24)), backend=llava_video, **GREEDY)
    assert first.text().startswith("<|im_start|>user\n<video>\nand<image>\nSame scene?")
    assert second["answer"] == first["answer"]
    meta = second.get_meta_info("answer")
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
    kinds = {r["kind"] for r in llava_video.media_snapshot()}
    assert kinds == {"image", "video"}


def test_text_only_model_gives_the_clear_error(tiny_models):
    with lmnb.Runtime(tiny_models["llama-gqa"], max_total_tokens=1024) as runtime:
        state = caption.run(pic=picture(0), backend=runtime)
        with pytest.raises(ProgramError, match=r"image\(\) needs a multimodal \(LLaVA\) "
                                               r"backend: llama-gqa takes no images"):
            state.text()
        assert runtime.media_snapshot() == []


def test_bad_media_fail_the_program_and_leave_the_runtime_usable(llava, tmp_path):
    state = caption.run(pic=str(tmp_path / "missing.png"), backend=llava)
    with pytest.raises(ProgramError, match="image file not found"):
        state.text()
    state = caption.run(pic="https://example.com/cat.png", backend=llava)
    with pytest.raises(ProgramError, match="not fetched"):
        state.text()
    assert caption.run(pic=picture(7), backend=llava, **GREEDY)["caption"]
    llava.check_integrity()


# ---- the endpoint and the server ----------------------------------------------------------------
def test_runtime_endpoint_sends_media(llava):
    from lmnb.server.serving import ServerHandle

    local = ask_many.run(pic=picture(20), questions=["What?", "Why?"], backend=llava, **GREEDY)
    server = ServerHandle.start(llava)
    try:
        endpoint = lmnb.RuntimeEndpoint(server.url)
        assert endpoint.media_token("image") == "<image>"
        remote = ask_many.run(pic=picture(20), questions=["What?", "Why?"], backend=endpoint,
                              **GREEDY)
        assert remote["answer"] == local["answer"]
        for fork in remote.ret_value:  # the branches' image span was cached on the server
            meta = fork.get_meta_info("answer")
            assert meta["cached_tokens"] == meta["prompt_tokens"] - 1
    finally:
        server.stop()


def test_select_after_an_image_over_the_endpoint_scores_as_in_process(llava):
    """lmnb's `RuntimeEndpoint` scores a select's choices past the image span as the in-process
    runtime does, though the server (as SGLang's) gives no logprob at the first prompt position
    it returns: the endpoint asks from one position earlier."""
    from lmnb.server.serving import ServerHandle

    @lmnb.function
    def is_cat(s, pic):
        s += user(image(pic) + "Is this a cat?")
        s += assistant(select("verdict", choices=["yes", "no", "maybe not"]))

    local = is_cat.run(pic=picture(4), backend=llava).get_meta_info("verdict")
    with ServerHandle.start(llava) as server:
        remote = is_cat.run(pic=picture(4), backend=lmnb.RuntimeEndpoint(server.url))
        meta = remote.get_meta_info("verdict")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        local["normalized_prompt_logprobs"], abs=1e-4)
    assert meta["input_token_ids"] == local["input_token_ids"]


def test_server_routes_take_images(llava, tmp_path):
    import base64
    import io
    import json
    import urllib.request

    import anthropic
    from PIL import Image

    from lmnb.server.serving import ServerHandle

    pic = picture(21)
    buffer = io.BytesIO()
    Image.fromarray(pic).save(buffer, format="PNG")
    b64 = base64.b64encode(buffer.getvalue()).decode()
    path = tmp_path / "pic.png"
    path.write_bytes(buffer.getvalue())
    prompt = "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    expected = llava.generate(prompt, {"max_new_tokens": 4, "temperature": 0},
                              image_data=pic)["text"]
    server = ServerHandle.start(llava)

    def post(route: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(server.url + route, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    try:
        params = {"max_new_tokens": 4, "temperature": 0}
        for data in (b64, f"data:image/png;base64,{b64}", str(path), [b64]):
            out = post("/generate", {"text": prompt, "sampling_params": params,
                                     "image_data": data})
            assert out["text"] == expected
            assert out["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 1
        chat = post("/v1/chat/completions", {
            "model": "x", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                {"type": "text", "text": "What is it?"}]}]})
        assert chat["choices"][0]["message"]["content"] == expected
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64}}
        ask = dict(model="x", max_tokens=4, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}])
        assert claude.messages.create(**ask).content[0].text == expected
        with claude.messages.stream(**ask) as stream:
            assert stream.get_final_message().content[0].text == expected
        by_url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0"):
            claude.messages.create(**{**ask, "messages": [{"role": "user",
                                                           "content": [by_url]}]})
        info = json.loads(urllib.request.urlopen(server.url + "/get_model_info").read())
        assert info["has_image_understanding"] and info["image_token"] == "<image>"
    finally:
        server.stop()


def test_anthropic_tool_result_images_reach_the_model(llava):
    """Images inside a `tool_result` block go to the model as top-level image blocks do (SGLang's
    endpoint takes them; they were a 400 'only text'), in prompt order: the tool results come
    before the rest of their user turn."""
    import base64
    import io

    import anthropic
    from PIL import Image

    from lmnb.server.serving import ServerHandle

    def block(pic: Any) -> dict[str, Any]:
        buffer = io.BytesIO()
        Image.fromarray(pic).save(buffer, format="PNG")
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(buffer.getvalue()).decode()}}

    snap, other = picture(25), picture(26)
    prompt = ("<|im_start|>user\nWhat do you see?<|im_end|>\n"
              "<|im_start|>assistant\n<tool_call>\n"
              '{"name": "snap", "arguments": {"zoom": 2}}\n</tool_call><|im_end|>\n'
              "<|im_start|>user\n<image>\n<tool_response>\nSnapshot:\n</tool_response>"
              "<|im_end|>\n<|im_start|>user\n<image>\nCompare.<|im_end|>\n"
              "<|im_start|>assistant\n")
    direct = llava.generate(prompt, {"max_new_tokens": 4, "temperature": 0},
                            image_data=[snap, other])
    expected = direct["text"]
    swapped = llava.generate(prompt, {"max_new_tokens": 4, "temperature": 0},
                             image_data=[other, snap])["text"]
    assert swapped != expected  # the answer tells the images' order
    messages = [
        {"role": "user", "content": "What do you see?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "snap",
                                           "input": {"zoom": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Snapshot:"}, block(snap)]},
            block(other), {"type": "text", "text": "Compare."}]}]
    with ServerHandle.start(llava) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        ask = dict(model="x", max_tokens=4, extra_body={"temperature": 0}, messages=messages)
        out = claude.messages.create(**ask)
        assert out.content[0].text == expected
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == (
            direct["meta_info"]["prompt_tokens"])
        with claude.messages.stream(**ask) as stream:
            assert stream.get_final_message().content[0].text == expected
    llava.check_integrity()


# ---- MediaReuseView ------------------------------------------------------------------------------
class FakeMediaRuntime:
    """`media_snapshot()` and `stats()` as a LLaVA Runtime gives them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.stats_ = {"media_tokens": 0, "cached_media_tokens": 0}
        self.closed = self.failed = False

    def media_snapshot(self) -> list[dict[str, Any]]:
        if self.closed:
            raise RuntimeError("this Runtime is closed; create a new one")
        return [dict(r) for r in self.rows]

    def stats(self) -> dict[str, Any]:
        if self.closed:
            raise RuntimeError("this Runtime is closed; create a new one")
        return dict(self.stats_)


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_media_reuse_view_needs_a_media_runtime():
    """Only a runtime with `media_snapshot()` (and `stats`, `closed`, `failed`) is shown."""
    pytest.importorskip("anywidget")
    from lmnb.widgets import MediaReuseView

    with pytest.raises(TypeError, match="object has no media_snapshot"):
        MediaReuseView(object(), interval_s=None)
    MediaReuseView(FakeMediaRuntime(), interval_s=None).close()


def test_media_reuse_view_on_a_fake_snapshot():
    pytest.importorskip("anywidget")
    from lmnb.widgets import MediaReuseView

    runtime = FakeMediaRuntime()
    view = MediaReuseView(runtime, interval_s=None)
    assert view.items == [] and view.summary["media"] == 0
    assert repr(view).startswith("MediaReuseView (live): 0 media")
    runtime.rows = [{"hash": "00000000deadbeef", "kind": "image", "num_tokens": 576,
                     "requests": 1, "hits": 0, "resident": True, "thumbnail": _png(),
                     "size": (300, 451)}]
    runtime.stats_ = {"media_tokens": 576, "cached_media_tokens": 0}
    view.refresh()
    (item,) = view.items
    assert item["change"] == "new" and item["thumbnail"].startswith("data:image/png;base64,")
    assert item["short_hash"] == "00000000" and item["size"] == [300, 451]
    runtime.rows = [{"hash": "0000000011112222", "kind": "video", "num_tokens": 1152,
                     "requests": 1, "hits": 0, "resident": True, "thumbnail": None,
                     "size": (720, 1280)},
                    {**runtime.rows[0], "requests": 4, "hits": 3, "resident": False}]
    runtime.stats_ = {"media_tokens": 576 * 4 + 1152, "cached_media_tokens": 576 * 3}
    view.refresh()
    video_item, image_row = view.items
    assert video_item["change"] == "new" and video_item["thumbnail"] is None
    assert image_row["change"] == "hit" and not image_row["resident"]
    assert view.summary == {"media": 2, "resident": 1, "evicted": 1, "hidden": 0,
                            "media_tokens": 3456, "cached_media_tokens": 1728,
                            "media_hit_rate": 0.5, "refreshes": 3}
    text = repr(view)
    assert text.splitlines() == [
        "MediaReuseView (live): 2 media, 1 resident, 1 evicted; media tokens served from "
        "cache: 1,728 of 3,456 (50.0%)",
        "  video 00000000  1280x720 px, 1152 tokens; 0 of 1 requests hit; resident",
        "  image 00000000  451x300 px, 576 tokens; 3 of 4 requests hit; evicted"]
    assert view._repr_mimebundle_()[0]["text/plain"] == text
    view.refresh()  # nothing changed: no redraw
    assert view.summary["refreshes"] == 3
    runtime.closed = True
    assert view.refresh() is False
    assert view.status == "stopped: the runtime is closed"
    json_state = view.get_state()
    assert json_state["_esm"] and json_state["items"] == view.items


def test_media_reuse_view_and_dashboard_on_a_runtime(llava):
    pytest.importorskip("anywidget")
    from lmnb.widgets import CacheDashboard, MediaReuseView

    assert llava.flush_cache()
    dashboard = CacheDashboard(llava, interval_s=None)
    view = MediaReuseView(llava, interval_s=None)
    pic = picture(30)
    ask_many.run(pic=pic, questions=["What?", "Why?", "How?"], backend=llava, **GREEDY)
    view.refresh()
    dashboard.refresh()
    key = f"{image_item(llava, pic).hash:016x}"
    (item,) = [i for i in view.items if i["hash"] == key]
    assert item["resident"] and item["hits"] == 3 and item["requests"] == 4
    assert item["thumbnail"].startswith("data:image/png;base64,")
    assert view.items[0]["hash"] == key  # most recent first
    last = dashboard.series[-1]
    assert last["media_tokens"] == 4 * item["num_tokens"]
    assert last["cached_media_tokens"] == 3 * item["num_tokens"]
    assert f"image/video tokens: cached {3 * item['num_tokens']} of " in repr(dashboard)
    assert f"{item['hits']} of {item['requests']} requests hit; resident" in repr(view)
    view.close()
    dashboard.close()
    assert view.status == "stopped"
