"""The bad-input matrix: each bad input gets one line (what, where, what to do), exit 2 for the
user's input and 1 for the environment, no traceback, and nothing written.

Models are tiny and saved from config objects (no download); the tokenizer is word-level with an
EOS and no pad token, so every calibration here also checks that a missing pad token is handled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fisher_select import load_run
from fisher_select.cli import main

WORDS = ["<unk>", "</s>", "hello", "world"] + [f"w{i}" for i in range(20)]
FAST = ["--samples-per-prompt", "2", "--max-new-tokens", "4", "--no-progress"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def save_model(path: Path, family: str, positions: int) -> Path:
    """A random tiny GPT-2 (learned positions) or Llama (RoPE) with ``positions`` context."""
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_embd=16, n_layer=1, n_head=2,
                                           n_positions=positions, bos_token_id=1, eos_token_id=1))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=positions, eos_token_id=1, bos_token_id=None))
    model.save_pretrained(path)
    tok = word_tokenizer()
    assert tok.pad_token is None  # the case under test: the tool must pick a pad itself
    tok.save_pretrained(path)
    return path


def write_recipe(tmp: Path, model: Path, prompts: list[dict], reward: str = "{type: regex, pattern: hello}") -> Path:
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    recipe = tmp / "recipe.yaml"
    recipe.write_text(f"model: {model}\nprompts: {data}\nobjective:\n  type: rl\n  reward: {reward}\n")
    return recipe


def fails(argv: list[str], capsys, code: int, *needles: str) -> str:
    """Run the CLI; it must exit ``code`` with one error line holding every needle, no traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if line.startswith("fisher-select:")]
    assert len(err) == 1, err
    for needle in needles:
        assert needle.lower() in err[0].lower(), (needle, err[0])
    assert "Traceback" not in err[0]
    return err[0]


def nothing_written(tmp: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "a temporary was left"


LONG = {"prompt": " ".join(["hello"] * 30)}  # 30 tokens
SHORT = {"prompt": "hello world"}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompt_past_the_context_is_refused_before_sampling(tmp_path, capsys, family):
    model = save_model(tmp_path / "m", family, positions=32)
    recipe = write_recipe(tmp_path, model, [SHORT, LONG, SHORT])
    out = tmp_path / "o"
    fails(["calibrate", "--recipe", str(recipe), "--out", str(out), *FAST], capsys, 2,
          "1 of 3 prompts do not fit", "context of 32", "has 30 tokens", "--truncate-prompts")
    nothing_written(tmp_path, out)


def test_truncate_prompts_cuts_to_the_last_tokens_and_says_how_many(tmp_path, capsys):
    model = save_model(tmp_path / "m", "gpt2", positions=32)
    recipe = write_recipe(tmp_path, model, [SHORT, LONG, SHORT])
    out = tmp_path / "o"
    assert main(["calibrate", "--recipe", str(recipe), "--out", str(out), "--truncate-prompts", *FAST]) == 0
    run = load_run(out)
    assert run.report.checks["prompts_truncated"] == 1
    assert any("1 of 3 prompts were cut" in w for w in run.report.warnings)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt_index"] for s in samples} == {0, 1, 2}
    assert run.report.command_line[:2] == ["fisher-select", "calibrate"]
    libraries = run.report.environment["libraries"]
    assert libraries["torch"] == torch.__version__.split("+")[0] or libraries["torch"] == torch.__version__


def test_truncation_with_no_room_for_a_prompt_is_refused(tmp_path, capsys):
    model = save_model(tmp_path / "m", "gpt2", positions=32)
    recipe = write_recipe(tmp_path, model, [SHORT])
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), "--truncate-prompts",
           "--samples-per-prompt", "2", "--max-new-tokens", "32", "--no-progress"], capsys, 2, "no room")


def test_wrong_prompt_field_names_are_listed(tmp_path, capsys):
    model = save_model(tmp_path / "m", "llama", positions=64)
    recipe = write_recipe(tmp_path, model, [{"question": "hello"}, {"question": "world"}])
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 2,
          "prompts.jsonl:1", "prompt")


@pytest.mark.parametrize("body,needle", [
    ("return None", "none"), ("return float('inf')", "inf"),
    ("while True:\n        pass", "timeout of 0.5 s"),
])
def test_reward_returning_none_inf_or_hanging(tmp_path, capsys, monkeypatch, body, needle):
    (tmp_path / "slowreward.py").write_text(f"def fn(record, text):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("slowreward", None)
    model = save_model(tmp_path / "m", "llama", positions=64)
    recipe = write_recipe(tmp_path, model, [SHORT, SHORT],
                          reward="{type: callable, function: 'slowreward:fn', timeout: 0.5}")
    started = time.monotonic()
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 2, needle, "prompt 0")
    assert time.monotonic() - started < 60
    nothing_written(tmp_path, tmp_path / "o")


def test_bad_reward_timeout_value(tmp_path, capsys):
    model = save_model(tmp_path / "m", "llama", positions=64)
    recipe = write_recipe(tmp_path, model, [SHORT], reward="{type: callable, function: 'x:y', timeout: -1}")
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 2, "timeout")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupted_safetensors_is_one_line(tmp_path, capsys, damage):
    model = save_model(tmp_path / "m", "llama", positions=64)
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    recipe = write_recipe(tmp_path, model, [SHORT])
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 2, str(model))
    nothing_written(tmp_path, tmp_path / "o")


def test_corrupted_gguf_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FISHER_SELECT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    recipe = write_recipe(tmp_path, gguf, [SHORT])
    fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 2, "model.gguf")
    nothing_written(tmp_path, tmp_path / "o")


def test_out_under_a_regular_file_fails_before_loading_anything(tmp_path, capsys, monkeypatch):
    import fisher_select.pipeline as pipeline

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(pipeline, "load_model", never)
    (tmp_path / "file").write_text("x")
    fails(["calibrate", "--out", str(tmp_path / "file" / "run"), *FAST], capsys, 2, str(tmp_path / "file"))


def test_a_disk_without_room_for_the_run_is_refused_after_loading_before_sampling(tmp_path, capsys, monkeypatch):
    """The run's size is known once the model is (4 bytes per coordinate per tensor file): a disk with
    less free space is refused before any sampling, naming the free and the needed space."""
    import shutil

    import fisher_select.atomic as atomic
    import fisher_select.pipeline as pipeline
    from fisher_select.run.write import run_bytes

    def never(*args, **kwargs):
        raise AssertionError("sampling started on a disk without room for the run")

    model = save_model(tmp_path / "m", "llama", positions=64)
    recipe = write_recipe(tmp_path, model, [SHORT])
    numel = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(model).parameters())
    need = run_bytes(numel, 1)
    real = shutil.disk_usage
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    monkeypatch.setattr(pipeline, "calibrate", never)
    line = fails(["calibrate", "--recipe", str(recipe), "--out", str(tmp_path / "o"), *FAST], capsys, 1, "free space")
    assert f"{need / 2**30:.2f} GiB" in line
    nothing_written(tmp_path, tmp_path / "o")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    model = save_model(tmp / "m", "llama", positions=64)
    recipe = write_recipe(tmp, model, [SHORT, {"prompt": "world hello"}])
    out = tmp / "run"
    assert main(["calibrate", "--recipe", str(recipe), "--out", str(out), *FAST]) == 0
    return out


@pytest.mark.parametrize("flags,needles", [
    (["--top", "0"], ["--top"]), (["--top", "2"], ["--top"]), (["--top", "-0.1"], ["--top"]),
    (["--fisher-mass", "1.5"], ["--fisher-mass"]), (["--bound-mass", "0"], ["--bound-mass"]), (["--threshold", "-1"], ["threshold"]),
])
def test_select_budgets_out_of_range(small_run, tmp_path, capsys, flags, needles):
    out = tmp_path / "mask.safetensors"
    fails(["select", str(small_run), *flags, "--out", str(out)], capsys, 2, *needles)
    assert not out.exists()


def test_select_out_on_a_path_that_cannot_be_created(small_run, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "mask.safetensors"
    code = main(["select", str(small_run), "--top", "0.1", "--out", str(out)])
    assert code in (1, 2)
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("fisher-select:")]
    assert len(err) == 1 and str(tmp_path / "file") in err[0] and "Traceback" not in err[0]


def test_run_from_an_older_format_is_refused_with_the_upgrade_command(small_run, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(small_run, old)
    report = json.loads((old / "report.json").read_text())
    report.pop("format_version")
    report["fisher_select_version"] = "0.1.0"
    (old / "report.json").write_text(json.dumps(report))
    fails(["select", str(old), "--top", "0.1", "--out", str(tmp_path / "m.safetensors")], capsys, 2,
          "0.1.0", f"fisher-select migrate {old}")
    assert main(["migrate", str(old)]) == 0
    capsys.readouterr()
    assert main(["select", str(old), "--top", "0.1", "--out", str(tmp_path / "m.safetensors")]) == 0


@pytest.mark.slow
def test_sigterm_during_sampling_exits_143_and_leaves_nothing(tmp_path):
    """A cluster time limit mid-run: exit 143, one line, neither the run nor a temporary left."""
    marker = tmp_path / "sampling-started"
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\n"
        "def fn(record, text):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    time.sleep(0.5)\n"
        "    return 1.0\n")
    model = save_model(tmp_path / "m", "llama", positions=64)
    recipe = write_recipe(tmp_path, model, [SHORT] * 8, reward="{type: callable, function: 'slow:fn'}")
    out = tmp_path / "o"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-m", "fisher_select", "calibrate", "--recipe", str(recipe),
                             "--out", str(out), *FAST], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the calibration never reached its reward"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    nothing_written(tmp_path, out)
