"""Bring your own rollouts: a file of prompts and responses is scored instead of sampling.

- a run's own samples.jsonl, re-scored with --rollouts, reproduces its Fisher, gradient estimate and
  S exactly (torch.equal on the CPU: the same token ids make the same batches, the same operations);
- a plain prompt / completion / reward file (text, EOS dropped by decoding) of the same samples, in
  JSONL and in Parquet, reproduces the Fisher computed in process;
- two gloo ranks on the same rollouts equal one process (fp32 sums added in another order: rtol 1e-6);
- rollouts from another model are reported as off-policy, with numbers; the file is validated up front.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import OPDPGObjective, RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.rollouts import load_rollouts
from fisher_select.report.warnings import mismatch_warnings
from fisher_select.calibration.teachers import Teacher, sequence_logprobs
from fisher_select.errors import FisherSelectError
from fisher_select.report.warnings import run_warnings
from fisher_select.run.load import load_run
from fisher_select.run.schema import RunReport
from tests.tiny import TinyTokenizer, enumeration_model, free_port, run_command

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 0", "3 3", "0 4 4", "2 2", "3 0 2"])]
K, SEED = 4, 3


def reward(record, text):
    return float(len(text.split()) % 2)


def _sampled(model=None, **kw):
    return calibrate(model or enumeration_model(), TinyTokenizer(5), PROMPTS, RLObjective(reward), samples_per_prompt=K,
                     max_new_tokens=3, seed=SEED, batch_size=8, progress=False, **kw)


def _rescored(path, model=None, objective=None, **kw):
    return calibrate(model or enumeration_model(), TinyTokenizer(5), None, objective or RLObjective(reward),
                     rollouts=load_rollouts(path), batch_size=8, progress=False, **kw)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _assert_equal(a, b):
    assert a.fisher.keys() == b.fisher.keys()
    for name in a.fisher:
        assert torch.equal(a.fisher[name], b.fisher[name]), name
        assert torch.equal(a.grad_estimate[name], b.grad_estimate[name]), name
    assert a.signal_scale == b.signal_scale and a.num_samples == b.num_samples


def test_own_samples_rescored_reproduce_the_run_exactly(tmp_path, small_llama_dir):
    """CLI, real tokenizer with a chat template: calibrate, then calibrate --rollouts its samples.jsonl."""
    args = ["--model", str(small_llama_dir), "--num-prompts", "4", "--samples-per-prompt", "3",
            "--max-new-tokens", "6", "--batch-size", "6", "--no-progress"]
    assert run_command(["calibrate", *args, "--out", str(tmp_path / "a")]) == 0
    assert run_command(["calibrate", *args, "--rollouts", str(tmp_path / "a" / "samples.jsonl"),
                        "--out", str(tmp_path / "b")]) == 0
    a, b = load_run(tmp_path / "a"), load_run(tmp_path / "b")
    assert a.fisher.keys() == b.fisher.keys() and all(torch.equal(a.fisher[n], b.fisher[n]) for n in a.fisher)
    from safetensors.torch import load_file
    ga, gb = (load_file(str(p / "grad_estimate.safetensors")) for p in (tmp_path / "a", tmp_path / "b"))
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
    assert a.signal_scale == b.signal_scale
    check = b.report.checks["rollouts"]
    assert check["verdict"] == "on-policy" and check["with_sampler_logprob"] == 12
    assert check["max_abs_mismatch"] < 1e-4  # KV-cached sampling vs one full forward, both fp32
    assert b.report.sampling["method"] == "rollouts" and b.report.samples_per_prompt == 3
    assert not any("rollouts" in w.lower() for w in b.report.warnings)


def _plain_rows(cal, drop_eos_text=True):
    """The samples as a plain prompt / completion / reward file: text only, as a trainer logs them."""
    tok = TinyTokenizer(5)
    return [{"prompt": s["prompt"], "completion": tok.decode(s["response_ids"], skip_special_tokens=drop_eos_text),
             "reward": s["value"]["rl"], "truncated": s["truncated"]} for s in cal.samples]


def test_plain_text_file_reproduces_the_in_process_fisher(tmp_path):
    cal = _sampled()
    assert 0 < cal.num_truncated < cal.num_samples  # both kinds: EOS put back, and not
    path = _write_jsonl(tmp_path / "plain.jsonl", _plain_rows(cal))
    back = _rescored(path, objective=RLObjective(lambda r, t: 1 / 0))  # the file's rewards, not the function
    _assert_equal(cal, back)
    assert back.num_truncated == cal.num_truncated
    assert back.checks["rollouts"]["verdict"] == "unchecked"  # no sampler log-probs in the file
    assert "nothing checks" in mismatch_warnings(back.checks["rollouts"])[0]


def test_parquet_file_reads_like_jsonl(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    cal = _sampled()
    rows = _plain_rows(cal)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "plain.parquet")
    _assert_equal(cal, _rescored(tmp_path / "plain.parquet"))


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "r.parquet").write_bytes(b"PAR1")
    with pytest.raises(FisherSelectError, match="pyarrow is not installed.*JSONL"):
        load_rollouts(tmp_path / "r.parquet")


def test_rollouts_from_another_model_are_reported_as_off_policy(tmp_path):
    cal = _sampled(enumeration_model(seed=1))
    rows = [{**s, "value": {}} for s in cal.samples]  # keep the sampler's "logprob"; rewards from the function
    back = _rescored(_write_jsonl(tmp_path / "other.jsonl", rows))
    check = back.checks["rollouts"]
    assert check["verdict"] == "off-policy" and check["off_policy_responses"] > 0
    per = [s["sampler_logprob"] - s["logprob"] for s in back.samples]
    assert check["max_abs_mismatch"] == pytest.approx(max(abs(d) for d in per))
    assert all("sampler_logprob" in s and "rollout_line" in s for s in back.samples)  # per response
    report = RunReport.from_json({**_minimal_report(), "checks": {"rollouts": check}}, "report.json")
    warning = run_warnings(report)[0]
    assert warning.startswith("OFF-POLICY ROLLOUTS") and f"{check['off_policy_responses']} of 24" in warning
    assert f"{check['max_abs_mismatch']:.4g}" in warning


def _minimal_report() -> dict:
    from fisher_select.run.schema import FORMAT_VERSION

    return {"format_version": FORMAT_VERSION, "run_id": "r", "model": {"name": "m", "fingerprint": {}, "path": None,
            "dtype": None, "quantization": None, "architecture": None}, "objectives": [{"name": "rl", "type": "rl",
            "signal_scale": 1.0}], "modules": [], "num_samples": 24, "num_prompts": 6}


def test_teacher_log_probs_from_the_file_replace_the_teacher(tmp_path):
    """opd-pg on rollouts with teacher_logprob: S and g as if the teacher had been run, whatever the recipe's teacher."""
    teacher = Teacher(enumeration_model(seed=2), name="teacher")
    cal = calibrate(enumeration_model(), TinyTokenizer(5), PROMPTS, OPDPGObjective(teacher), samples_per_prompt=K,
                    max_new_tokens=3, seed=SEED, batch_size=8, progress=False)
    rows = [{**s, "value": {}, "teacher_logprob": float(sequence_logprobs(teacher.model, [s["prompt_ids"]],
                                                                          [s["response_ids"]])[0])}
            for s in cal.samples]
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    back = _rescored(path, objective=OPDPGObjective(Teacher(enumeration_model(seed=9), name="wrong")))
    assert back.fisher.keys() == cal.fisher.keys() and all(torch.equal(cal.fisher[n], back.fisher[n]) for n in cal.fisher)
    # log pi is recomputed in one forward (sampling summed it step by step): equal to float tolerance
    assert back.signal_scale == pytest.approx(cal.signal_scale, rel=1e-5)


def test_every_problem_is_listed_in_one_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "2 3", "response": "3", "reward": 1}),
        "{not json",
        json.dumps({"response": "3"}),
        json.dumps({"prompt": "2 3", "response_ids": [2, -1], "reward": "high"}),
        json.dumps({"prompt": "2 3", "response": "3", "sampler_logprob": 0.5, "truncated": "no"}),
        json.dumps([1, 2]),
    ]) + "\n")
    with pytest.raises(FisherSelectError) as err:
        load_rollouts(path)
    text = str(err.value)
    for needle in ("line 2: invalid JSON", "line 3: no prompt", 'line 4: "response_ids"', 'line 4: "reward"',
                   'line 5: "sampler_logprob"', 'line 5: "truncated"', "line 6: got list", "docs/ROLLOUTS.md"):
        assert needle in text, needle
    assert "\n" not in text


def test_unequal_groups_and_model_mismatches_are_refused(tmp_path):
    rows = [{"prompt": "2 3", "response": "3"}] * 3 + [{"prompt": "4", "response": "2"}] * 2 \
        + [{"prompt": "3", "response": "2"}] * 3
    with pytest.raises(FisherSelectError, match="1 prompt.s. have 2 responses where most have 3"):
        load_rollouts(_write_jsonl(tmp_path / "k.jsonl", rows))
    rows = [{"prompt": "2 3", "response_ids": [7, 1], "sampler_token_logprobs": [-1.0]}] * 2
    with pytest.raises(FisherSelectError) as err:
        _rescored(_write_jsonl(tmp_path / "v.jsonl", rows))
    assert "line 1: token id 7 is outside the model's vocabulary of 5" in str(err.value)
    assert 'line 2: "sampler_token_logprobs" has 1 entries but the response has 2 tokens' in str(err.value)


# ---------------------------------------------------------------------------
# Two gloo ranks on the same rollouts


def _worker(rank, world, port, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cal = _rescored(path)
        if rank == 0:  # tensors as safetensors, the rest as JSON: nothing pickled
            from safetensors.torch import save_file
            save_file({**{f"F/{k}": v for k, v in cal.fisher.items()},
                       **{f"g/{k}": v for k, v in cal.grad_estimate.items()}}, out + ".safetensors")
            with open(out + ".json", "w") as f:
                json.dump({"S": cal.signal_scale, "n": cal.num_samples, "samples": cal.samples,
                           "check": cal.checks["rollouts"]}, f)
    finally:
        dist.destroy_process_group()



@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
@pytest.mark.slow
def test_two_ranks_on_rollouts_equal_one_process(tmp_path):
    from safetensors.torch import load_file

    cal = _sampled()
    path = _write_jsonl(tmp_path / "s.jsonl", cal.samples)
    one = _rescored(path)
    out = str(tmp_path / "rank0")
    mp.start_processes(_worker, args=(2, free_port(), str(path), out), nprocs=2, start_method="spawn")
    tensors, meta = load_file(out + ".safetensors"), json.loads(open(out + ".json").read())
    assert meta["n"] == one.num_samples == len(PROMPTS) * K
    for name in one.fisher:  # the same terms, summed per rank then across ranks: float tolerance
        assert torch.allclose(tensors[f"F/{name}"], one.fisher[name], rtol=1e-6, atol=1e-12), name
        g = one.grad_estimate[name]  # signed terms cancel: the tolerance is relative to the tensor's scale
        assert torch.allclose(tensors[f"g/{name}"], g, rtol=1e-6, atol=1e-6 * float(g.abs().max())), name
    assert meta["S"] == pytest.approx(one.signal_scale, rel=1e-12)
    key = lambda s: (s["prompt_index"], s["rollout_line"])  # noqa: E731
    two_samples, one_samples = sorted(meta["samples"], key=key), sorted(one.samples, key=key)
    # log pi is recomputed in other batches (other padding widths): equal to float tolerance only
    assert [s["logprob"] for s in two_samples] == pytest.approx([s["logprob"] for s in one_samples], abs=1e-5)
    strip = lambda s: {k: v for k, v in s.items() if k != "logprob"}  # noqa: E731
    assert [strip(s) for s in two_samples] == [strip(s) for s in one_samples]
    for k in ("verdict", "off_policy_responses", "with_sampler_logprob"):
        assert meta["check"][k] == one.checks["rollouts"][k], k


def test_rows_without_a_reward_are_named_by_their_own_lines(tmp_path):
    """The lines lacking a reward are listed, not the group's first line (which may have one)."""
    has, lacks = {"prompt": "2 3", "response": "3", "reward": 1}, {"prompt": "2 3", "response": "3"}
    with pytest.raises(FisherSelectError) as err:
        _rescored(_write_jsonl(tmp_path / "second.jsonl", [has, lacks, has, lacks]))
    assert "no reward on line(s) 2, 4)" in str(err.value)
    with pytest.raises(FisherSelectError) as err:
        _rescored(_write_jsonl(tmp_path / "first.jsonl", [lacks, has, has, has]))
    assert "no reward on line(s) 1)" in str(err.value)
