"""A model's recommended sampling parameters (generation_config.json) as the defaults of OpenAI
requests that leave them out, as SGLang's `--sampling-defaults model` and vLLM's
`--generation-config auto` serve them; `sampling_defaults="openai"` turns them off. Driven through
the `openai` client against the server over a tiny model whose generation_config.json states
them; a wrapper around `Runtime.generate` records what the server asks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lmnb.runtime.config import EngineConfig
from lmnb.runtime.engine import Runtime
from lmnb.runtime.generation_defaults import read_generation_defaults
from lmnb.server import ServerHandle

RECOMMENDED = {"temperature": 0.0, "top_k": 1, "top_p": 0.9, "min_p": 0.05,
               "repetition_penalty": 1.3}
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def recommending_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny GQA Llama with RECOMMENDED (and fields lmnb does not take) in its
    generation_config.json."""
    target = tmp_path_factory.mktemp("recommending") / "llama-gqa"
    shutil.copytree(tiny_models["llama-gqa"], target)
    path = target / "generation_config.json"
    stated = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**stated, **RECOMMENDED, "do_sample": False,
                                "max_new_tokens": 3}))
    return target


def _served(model: Path, **options: Any) -> Iterator[tuple[Runtime, ServerHandle]]:
    runtime = Runtime(model, max_total_tokens=2048, **options)
    try:
        with ServerHandle.start(runtime, served_model_name="tiny") as handle:
            yield runtime, handle
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def model_defaults(recommending_model) -> Iterator[tuple[Runtime, ServerHandle]]:
    yield from _served(recommending_model)


@pytest.fixture(scope="module")
def openai_defaults(recommending_model) -> Iterator[tuple[Runtime, ServerHandle]]:
    yield from _served(recommending_model, sampling_defaults="openai")


def _client(handle: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="none", max_retries=0)


def _recorded(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The sampling parameters of every `generate` call the server makes from now on."""
    seen: list[dict[str, Any]] = []
    generate = runtime.generate

    def recording(prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        seen.append(dict(sampling_params or {}))
        return generate(prompt, sampling_params, **kwargs)

    monkeypatch.setattr(runtime, "generate", recording)
    return seen


def _sampling(params: dict[str, Any]) -> dict[str, Any]:
    return {key: params[key] for key in RECOMMENDED if key in params}


def test_the_model_config_holds_the_recommended_parameters(recommending_model, tiny_models,
                                                           tmp_path):
    assert read_generation_defaults(recommending_model) == RECOMMENDED
    assert read_generation_defaults(tiny_models["llama-gqa"]) == {}  # ids only, as HF saves it
    assert read_generation_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": "hot", "top_k": 2.5, "top_p": True, "min_p": 0.1}))
    assert read_generation_defaults(tmp_path) == {"min_p": 0.1}
    with pytest.raises(ValueError, match="sampling_defaults 'vllm'; choose one of: model, openai"):
        EngineConfig(sampling_defaults="vllm")


def test_recommended_parameters_do_not_key_the_disk_kv(recommending_model, tiny_models):
    """The disk tier keys KV pages by the model config's repr (`hicache/identity.py`): a
    generation_config.json's sampling values change no KV, so they are not in it."""
    from lmnb.runtime.models.loader import load_model_config

    recommending = load_model_config(recommending_model)
    assert recommending.generation_defaults == RECOMMENDED
    assert repr(recommending) == repr(load_model_config(tiny_models["llama-gqa"]))


def test_omitted_fields_take_the_models_values(model_defaults, monkeypatch):
    runtime, handle = model_defaults
    assert runtime.model_config.generation_defaults == RECOMMENDED
    client = _client(handle)
    seen = _recorded(runtime, monkeypatch)
    omitted = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, seed=5)
    client.completions.create(model="tiny", prompt="The sky", max_tokens=4, seed=5)
    assert [_sampling(params) for params in seen] == [RECOMMENDED, RECOMMENDED]
    assert seen[0]["max_new_tokens"] == 8  # max_new_tokens is not taken from the file
    # what the omitted fields did: the same text as the model's values sent explicitly
    explicit = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, top_p=0.9, seed=7,
        extra_body={"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.3})
    assert omitted.choices[0].message.content == explicit.choices[0].message.content


def test_explicit_values_win(model_defaults, monkeypatch):
    runtime, handle = model_defaults
    seen = _recorded(runtime, monkeypatch)
    client = _client(handle)
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0.7,
                                   seed=1, extra_body={"top_k": 20, "repetition_penalty": 1.0})
    client.completions.create(model="tiny", prompt="The sky", max_tokens=4, top_p=1.0,
                              temperature=None)  # null: not given, the model's value
    assert [_sampling(params) for params in seen] == [
        {**RECOMMENDED, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.0},
        {**RECOMMENDED, "top_p": 1.0}]


def test_native_generate_keeps_its_own_defaults(model_defaults, monkeypatch):
    """SGLang applies the model's values to its OpenAI chat only: /generate is unchanged."""
    runtime, handle = model_defaults
    seen = _recorded(runtime, monkeypatch)
    reply = httpx.post(f"{handle.url}/generate", timeout=60,
                       json={"text": "The sky", "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200
    assert [_sampling(params) for params in seen] == [{}]


def test_openai_sampling_defaults_ignore_the_file(openai_defaults, model_defaults, monkeypatch):
    runtime, handle = openai_defaults
    seen = _recorded(runtime, monkeypatch)
    client = _client(handle)
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, seed=5)
    client.completions.create(model="tiny", prompt="The sky", max_tokens=4,
                              extra_body={"top_k": 3})
    assert [_sampling(params) for params in seen] == [{}, {"top_k": 3}]
    info = httpx.get(f"{handle.url}/server_info", timeout=60).json()
    assert info["sampling_defaults"] == "openai"
    info = httpx.get(f"{model_defaults[1].url}/server_info", timeout=60).json()
    assert info["sampling_defaults"] == "model"


def test_cli_and_magic_pass_the_option(recommending_model, monkeypatch):
    """`python -m lmnb serve --sampling-defaults` and `%lmnb load --sampling-defaults`."""
    import lmnb.server
    from lmnb.__main__ import main

    chosen: list[str] = []

    def fake_serve(runtime: Runtime, **options: Any) -> None:  # instead of blocking in uvicorn
        chosen.append(runtime.engine_config.sampling_defaults)

    monkeypatch.setattr(lmnb.server, "serve", fake_serve)
    for flags, expected in (([], "model"), (["--sampling-defaults", "openai"], "openai")):
        assert main(["serve", str(recommending_model), "--max-total-tokens", "512",
                     "--device", "cpu", *flags]) == 0
        assert chosen.pop() == expected

    from tests.lmnb_shell import lmnb_shell

    with lmnb_shell() as shell:
        shell.run_line_magic("lmnb", f"load {recommending_model} --max-total-tokens 512 "
                                     "--sampling-defaults openai")
        runtime = shell.magics_manager.registry["LMNB"].session.runtime
        assert runtime.engine_config.sampling_defaults == "openai"
