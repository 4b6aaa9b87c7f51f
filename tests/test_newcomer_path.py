"""The newcomer's path (issue 21): phase lines without progress bars, memory estimated before any work,
large K sampled in chunks, damaged run files refused as bad input."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import run_command


def _recipe(tmp_path, model_dir, prompts=2):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(prompts)))
    (tmp_path / "r.yaml").write_text(f"model: {model_dir}\nprompts: p.jsonl\nobjective:\n  type: rl\n"
                                     "  reward: {type: regex, pattern: '[0-9]'}\n")
    return str(tmp_path / "r.yaml")


def test_no_progress_prints_one_line_per_phase_on_stderr(tmp_path, small_llama_dir, capsys):
    assert run_command(["calibrate", "--recipe", _recipe(tmp_path, small_llama_dir), "--out", str(tmp_path / "run"),
                        "--samples-per-prompt", "2", "--max-new-tokens", "4", "--batch-size", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    starts = ["model loaded: ", "first batch: ", "sampling done: ", "scoring done: ", "checks: ", "written: "]
    lines = [line for line in err if line.startswith(tuple(starts))]
    assert [next(s for s in starts if line.startswith(s)) for line in lines] == starts, err
    assert "first batch: 2 samples sampled and scored in " in lines[1] and "the other 1 batch(es) take about" in lines[1]
    assert "tokens/s" in lines[2] and "samples/s" in lines[3] and "autograd ok" in lines[4]
    assert lines[5] == f"written: {tmp_path / 'run'}"


def test_calibrate_refuses_before_sampling_when_the_estimate_exceeds_the_memory(tmp_path, small_llama_dir, capsys,
                                                                                 monkeypatch):
    from fisher_select.calibration import batches
    from fisher_select.cli import main

    monkeypatch.setenv("FISHER_SELECT_MEMORY_LIMIT", "100000")  # 100 kB: nothing fits
    monkeypatch.setattr(batches, "sample_responses", lambda *a, **k: pytest.fail("sampled before refusing"))
    out = tmp_path / "run"
    code = main(["calibrate", "--recipe", _recipe(tmp_path, small_llama_dir), "--out", str(out),
                 "--samples-per-prompt", "2", "--max-new-tokens", "4", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and not out.exists()
    assert "this calibration needs about " in err and "but only 0.00 GiB is available on cpu " in err
    assert "(FISHER_SELECT_MEMORY_LIMIT)" in err and "accumulators " in err and "sampling " in err
    for flag in ("--batch-size", "--accumulators gradient or fisher", "--accumulate-on cpu", "--samples-per-prompt",
                 "--num-prompts"):
        assert flag in err, flag


def test_a_bad_memory_limit_is_one_clear_error(monkeypatch):
    from fisher_select.calibration.budget import available_memory
    from fisher_select.errors import FisherSelectError

    monkeypatch.setenv("FISHER_SELECT_MEMORY_LIMIT", "lots")
    with pytest.raises(FisherSelectError, match="FISHER_SELECT_MEMORY_LIMIT='lots' is not a number of bytes"):
        available_memory(torch.device("cpu"))
    monkeypatch.setenv("FISHER_SELECT_MEMORY_LIMIT", "1e3")
    assert available_memory(torch.device("cpu")) == (1000, "FISHER_SELECT_MEMORY_LIMIT")


def test_the_estimate_counts_each_memory_mode_and_the_rows_of_one_call():
    from fisher_select.calibration.budget import estimate_memory
    from fisher_select.engine.memory import MemoryMode
    from tests.tiny import tiny_model

    model = tiny_model("llama-untied")
    n = sum(p.numel() for p in model.parameters())
    est = {acc: estimate_memory(model, MemoryMode(acc), n, objectives=2, stability=True, sample_rows=4, score_rows=2,
                                tokens=10) for acc in ("full", "gradient", "fisher")}
    assert [est[a].accumulators for a in ("full", "gradient", "fisher")] == [4 * n * 5, 4 * n * 4, 4 * n * 2]
    from fisher_select.engine.batching import bytes_per_token

    vocab = model.config.vocab_size
    assert est["full"].scoring == 2 * 10 * bytes_per_token(model)  # the rows x tokens of one scoring pass
    budgeted = estimate_memory(model, MemoryMode("full"), n, objectives=2, stability=True, sample_rows=4,
                               score_rows=2, tokens=10, max_tokens=12)
    assert budgeted.scoring == 10 * bytes_per_token(model)  # the token budget passes one row at a time
    assert est["full"].sampling > 2 * 4 * vocab * 4  # logits of one step, beside the KV cache


K_BIG, PROMPTS = 10, ["2 3", "4 2 0"]


def _calibrate_rl(batch_size):
    from fisher_select.calibration.calibrator import calibrate
    from fisher_select.calibration.objectives import RLObjective
    from fisher_select.calibration.prompts import PromptRecord
    from tests.tiny import TinyTokenizer, enumeration_model

    records = [PromptRecord(i, p, None, {}) for i, p in enumerate(PROMPTS)]
    return calibrate(enumeration_model(), TinyTokenizer(5), records, RLObjective(lambda r, t: float(len(t.split()) % 2)),
                     samples_per_prompt=K_BIG, max_new_tokens=3, seed=3, batch_size=batch_size, progress=False)


def test_k_above_the_batch_size_is_scored_in_batch_size_chunks_with_the_same_result(monkeypatch):
    from fisher_select.calibration import parallel

    whole = _calibrate_rl(batch_size=K_BIG)  # one scoring call per prompt
    widths = []
    real = parallel.score_in_budget  # every scoring call of the calibration goes through it
    monkeypatch.setattr(parallel, "score_in_budget", lambda model, ids, *a, **k: widths.append(len(ids)) or
                        real(model, ids, *a, **k))
    chunked = _calibrate_rl(batch_size=3)  # the same draws (one sampling call of K rows), scored 3 rows at a time
    assert max(widths) <= 3 and chunked.num_samples == whole.num_samples == K_BIG * len(PROMPTS)
    assert [s["response_ids"] for s in chunked.samples] == [s["response_ids"] for s in whole.samples]
    assert chunked.signal_scale == whole.signal_scale
    for name in whole.fisher:
        torch.testing.assert_close(chunked.fisher[name], whole.fisher[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(chunked.grad_estimate[name], whole.grad_estimate[name], rtol=1e-5, atol=1e-7)


def test_a_huge_k_is_sampled_in_chunks_of_bounded_rows(monkeypatch):
    from fisher_select.calibration import batches, budget

    monkeypatch.setattr(budget, "SAMPLE_ROWS", 4)  # stands for 1024: K = 10 is "huge" here
    rows = []
    real = batches.sample_responses
    monkeypatch.setattr(batches, "sample_responses", lambda model, prompts, **k: rows.append(len(prompts)) or
                        real(model, prompts, **k))
    cal = _calibrate_rl(batch_size=2)
    assert rows == [4, 4, 2] * len(PROMPTS)  # per prompt: K = 10 rows in calls of at most 4
    assert cal.num_samples == K_BIG * len(PROMPTS) and [s["prompt_index"] for s in cal.samples] == [0] * 10 + [1] * 10


# ---------------------------------------------------------------------------
# Damaged run files: exit 2 naming the file, what is wrong and what to do; nothing half-written

# Which commands read each file of a run directory. report.md and report.html are read by no command
# (`report` rewrites them), `report` reads tensors only with --recompute (it redraws from report.json),
# and `verify` compares samples.jsonl byte for byte without parsing it (a damaged copy is reported as
# a difference, exit 1).
READERS = {"fisher.safetensors": ("recompute", "select", "verify"), "bounds.safetensors": ("verify",),
           "grad_estimate.safetensors": ("recompute", "verify"), "samples.jsonl": ("report", "recompute"),
           "report.json": ("report", "recompute", "select", "verify")}
EXEMPT = {"report.md", "report.html"}
DAMAGES = {"truncated": lambda data: data[: len(data) // 2], "emptied": lambda data: b"",
           "garbage": lambda data: bytes((i * 131 + 7) % 256 for i in range(len(data)))}


# What the message says is wrong, per kind of file and damage (any one phrase of each tuple).
WHAT = {("safetensors", "truncated"): ("truncated tensor data", "truncated safetensors header"),
        ("safetensors", "emptied"): ("is empty",), ("safetensors", "garbage"): ("truncated safetensors header",),
        ("json", "truncated"): ("is not valid JSON",), ("json", "emptied"): ("is empty",),
        ("json", "garbage"): ("is not text",), ("jsonl", "truncated"): ("not valid JSON", "emptied or truncated"),
        ("jsonl", "emptied"): ("holds 0 sample record(s)",), ("jsonl", "garbage"): ("is not text",)}


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[1]


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory, small_llama_dir):
    out = tmp_path_factory.mktemp("damaged") / "run"
    assert run_command(["calibrate", "--model", str(small_llama_dir), "--num-prompts", "2", "--samples-per-prompt", "2",
                        "--max-new-tokens", "4", "--no-progress", "--out", str(out)]) == 0
    return out


def test_every_run_file_is_read_by_some_command_or_exempt(pristine_run):
    assert {p.name for p in pristine_run.iterdir()} == set(READERS) | EXEMPT


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("name", sorted(READERS))
def test_a_damaged_run_file_is_bad_input_named_with_what_to_do(tmp_path, pristine_run, capsys, name, damage):
    import shutil

    from fisher_select.cli import main

    run = shutil.copytree(pristine_run, tmp_path / "run")
    target = run / name
    target.write_bytes(DAMAGES[damage](target.read_bytes()))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    commands = {"report": ["report", str(run)], "recompute": ["report", str(run), "--recompute"],
                "verify": ["verify", str(run), str(pristine_run)],
                "select": ["select", str(run), "--top", "0.01", "--out", str(tmp_path / "m.safetensors")]}
    for command in READERS[name]:
        code = main(commands[command])
        err = capsys.readouterr().err
        assert code == 2, (command, err)
        assert str(target) in err and "internal error" not in err and "re-run" in err, (command, err)
        assert len(err.strip().splitlines()) == 1, err
        assert any(phrase in err for phrase in WHAT[_kind(name), damage]), (command, err)
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before, command  # nothing rewritten
        assert not list(tmp_path.glob("m.safetensors*")), command


def test_a_container_limit_is_read_from_cgroup_v2(tmp_path):
    from fisher_select.calibration.budget import _cgroup_room

    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    assert _cgroup_room(str(tmp_path)) == 600000
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert _cgroup_room(str(tmp_path)) is None
    assert _cgroup_room(str(tmp_path / "absent")) is None


def test_a_token_level_objective_is_cut_along_k_with_its_token_signals():
    """Chunked scoring slices each response's token signals with it: the token-level gradient estimate (no random
    signs in it) equals the unchunked one on the same samples."""
    from fisher_select.calibration.calibrator import calibrate
    from fisher_select.calibration.objectives import OPDFullObjective
    from fisher_select.calibration.teachers import Teacher
    from tests.test_token_fisher import MAX_NEW, VOCAB, records, student, teacher
    from tests.tiny import TinyTokenizer

    def run(batch_size):
        return calibrate(student(), TinyTokenizer(VOCAB), records(), OPDFullObjective(Teacher(teacher("near"))),
                         samples_per_prompt=6, max_new_tokens=MAX_NEW, seed=5, batch_size=batch_size, progress=False)

    whole, chunked = run(6), run(4)
    assert [s["response_ids"] for s in chunked.samples] == [s["response_ids"] for s in whole.samples]
    for name in whole.grad_estimate:
        torch.testing.assert_close(chunked.grad_estimate[name], whole.grad_estimate[name], rtol=1e-5, atol=1e-7)
    assert chunked.token_fisher.keys() == whole.token_fisher.keys()
