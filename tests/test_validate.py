"""Validation against real training (`fisher-select validate`): metrics on hand-checked examples,
Spectrum's SNR against a hand-computed SVD, the training loop's gradient against the brute-force
per-sample reference, the first-step check on an exactly enumerated model, and small end-to-end runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import OPDFullObjective, RLObjective, SFTDemonstrationsObjective
from fisher_select.calibration.objectives.base import Context
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.teachers import Teacher
from fisher_select.engine.reference import brute_force_sums, per_sample_scores, per_token_scores
from fisher_select.errors import FisherSelectError
from fisher_select.report.validation_section import summary_lines
from fisher_select.stats.ranking import top_count
from fisher_select.stats.naming import module_of
from fisher_select.studies import baselines
from fisher_select.studies.loop import Streams, backward, make_task, pad_rows, token_weights
from fisher_select.studies.metrics import (Realized, Subsample, auroc, first_step_check, ranking_metrics,
                                            spacing)
from fisher_select.studies.movement import bf16_lost, movement, snapshot
from fisher_select.studies.first_step import minibatch_snr, row_score_sums, sgd_step, split_half_gradient
from fisher_select.studies.validate import Setup, ValidationConfig, global_top_masks, recovered_share, validate
from tests import enumeration as en
from tests.runs import make_run
from tests.tiny import TinyTokenizer, tiny_model

# ---------------------------------------------------------------------------
# Metrics on hand-checked examples


def test_auroc_counts_pairs_and_half_ties():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    moved = torch.tensor([True, False, True, False, False, False])
    assert auroc(scores, moved) == pytest.approx(7 / 8)  # 0.9 beats 4 negatives, 0.7 beats 3 of them
    assert auroc(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([True, False, False])) == pytest.approx(0.75)
    assert auroc(scores, torch.zeros(6, dtype=torch.bool)) is None


def test_precision_recall_jaccard_at_k_on_a_hand_built_ranking():
    """Movement 0..999 (moved = top 1% = 990..999). The ranking puts 995..999 first, then five
    unmoved coordinates 0..4 (tied), then the rest in movement order."""
    move = torch.arange(1000, dtype=torch.float32)
    score = move / 1000
    score[995:] = 2 + torch.arange(5.0)
    score[:5] = 1.5
    m, curve = ranking_metrics(score, Realized(move, (0.01, 0.5), seed=0), seed=1, fractions=(0.01, 0.5))
    assert m["precision_at_k"] == pytest.approx({"0.001": 1.0, "0.01": 0.5, "0.1": 0.1})
    assert m["recall_at_k"] == pytest.approx({"0.001": 0.1, "0.01": 0.5, "0.1": 1.0})
    assert m["jaccard_at_k"] == pytest.approx({"0.001": 1.0, "0.01": 5 / 15, "0.1": 95 / 105})
    # q = 0.99: 995..999 beat all 990 unmoved; 990..994 lose only to the five 1.5s
    assert m["auroc"]["q0.99"] == pytest.approx((5 * 990 + 5 * 985) / (10 * 990))
    assert curve == pytest.approx([0.5, 495 / 500])  # top 500 by score: 0..4 are outside the realized top 500


def test_subsample_is_distinct_seeded_and_takes_the_right_values():
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2)}
    tensors = {n: torch.randn(s) for n, s in shapes.items()}
    every = torch.cat([t.reshape(-1) for t in tensors.values()])
    sub = Subsample(shapes, 9, seed=3)
    assert sub.size == 9 and sub.total == 21 and len(set(sub.flat.tolist())) == 9
    assert torch.equal(sub.take(tensors), every[sub.flat])
    assert torch.equal(Subsample(shapes, 9, seed=3).flat, sub.flat)
    assert torch.equal(Subsample(shapes, None, seed=0).take(tensors), every)
    assert sub.broadcast([1.0, 2.0, 3.0]).tolist() == [[1.0, 2.0, 3.0][int(j)] for j in sub.param_of]


def test_recovered_share_of_full_fine_tuning_on_hand_checked_numbers():
    # a loss: 2.0 -> 1.0 with full fine-tuning, 2.0 -> 1.5 with a mask: half the improvement
    assert recovered_share(2.0, 1.5, 1.0) == 0.5
    # a reward: 0.2 -> 0.6 full, 0.2 -> 0.5 masked: three quarters; a mask that made it worse: negative
    assert recovered_share(0.2, 0.5, 0.6) == pytest.approx(0.75)
    assert recovered_share(0.2, 0.1, 0.6) == pytest.approx(-0.25)
    assert recovered_share(1.0, 1.2, 1.0) is None  # full fine-tuning changed nothing: no share


def test_global_top_masks_count_exactly_across_tensors():
    scores = {"a": torch.tensor([[5.0, 0.0], [3.0, 1.0]]), "b": torch.tensor([4.0, 2.0, 6.0])}
    masks = global_top_masks(scores, 3 / 7)
    assert masks["a"].tolist() == [[True, False], [False, False]] and masks["b"].tolist() == [True, False, True]


# ---------------------------------------------------------------------------
# Spectrum's SNR, by hand


def test_spectrum_snr_matches_a_hand_computed_svd():
    """W (5 x 8) with singular values 10, 3, 1, 0.5, 0.2: quartiles 0.5 and 3 (linear interpolation),
    sigma = 2.5 / 1.349, MP threshold sigma (1 + sqrt(5/8)) = 3.318; signal = 10, noise = 4.7."""
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(8, 5, generator=gen, dtype=torch.float64))
    s = torch.tensor([10.0, 3.0, 1.0, 0.5, 0.2], dtype=torch.float64)
    w = (u * s) @ v.T  # (5, 8)
    threshold = 2.5 / 1.349 * (1 + math.sqrt(5 / 8))
    assert 3 < threshold < 10  # only the largest singular value is signal
    assert baselines.spectrum_snr(w.float()) == pytest.approx((10 / 4.7) / 10, rel=1e-5)
    assert baselines.spectrum_snr(w.T.float()) == pytest.approx((10 / 4.7) / 10, rel=1e-5)  # beta = m/n
    assert baselines.spectrum_snr(torch.tensor([3.0, 4.0])) == pytest.approx(1.0)  # 1-D: one singular value


def _numpy_spectrum(w: np.ndarray) -> float:
    """Spectrum's rule written again in numpy: IQR sigma, MP edge sigma (1 + sqrt(min/max)), signal/noise/S[0]."""
    w = w.reshape(1, -1) if w.ndim == 1 else w  # Spectrum treats a vector as one row
    s = np.linalg.svd(w, compute_uv=False)
    q25, q75 = np.percentile(s, [25, 75])  # linear interpolation, as torch.quantile
    edge = (q75 - q25) / 1.349 * (1 + math.sqrt(min(w.shape) / max(w.shape)))
    signal, noise = s[s > edge].sum(), s[s <= edge].sum()
    return float((signal / (noise if (s <= edge).any() else 1.0)) / s[0])


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (12, 12), (7,)])
def test_spectrum_snr_matches_numpy_on_random_low_rank_plus_noise(shape):
    gen = np.random.default_rng(sum(shape))
    w = gen.normal(size=shape)
    if len(shape) == 2:  # a rank-2 spike above the noise, so the threshold separates something
        w += 6 * np.outer(gen.normal(size=shape[0]), gen.normal(size=shape[1])) / math.sqrt(max(shape))
    assert baselines.spectrum_snr(torch.tensor(w, dtype=torch.float32)) == pytest.approx(_numpy_spectrum(w), rel=1e-4)


def test_spectrum_selection_takes_half_of_each_type_plus_embeddings_and_head():
    scores = {"model.embed_tokens": 0.0, "lm_head": 0.0, "model.norm": 1.0,
              **{f"model.layers.{i}.mlp.up_proj": float(i) for i in range(4)},
              **{f"model.layers.{i}.self_attn.q_proj": float(-i) for i in range(4)}}
    chosen = baselines.spectrum_selection(scores)
    assert chosen == {"model.embed_tokens", "lm_head", "model.layers.2.mlp.up_proj", "model.layers.3.mlp.up_proj",
                      "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}


def test_kappa_scores_follow_numpy_condition_numbers_on_a_tiny_model():
    """PEFT's KappaTune through ``kappa_module_scores``: lowest condition number first (numpy SVD), the
    default targets are its lowest 20% of the nn.Linear modules. A peft without KappaTune: no scores, one reason."""
    model = tiny_model("llama-untied")
    scores, targets, how = baselines.kappa_module_scores(model)
    try:
        from peft import find_kappa_target_modules  # noqa: F401
    except ImportError:
        assert scores is None and targets is None and "find_kappa_target_modules" in how
        return
    kappa = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            sv = np.linalg.svd(module.weight.detach().double().numpy(), compute_uv=False)
            kappa[name] = sv[0] / (sv[-1] + 1e-8)
    assert set(scores) == set(kappa)
    by_score = sorted(scores, key=lambda n: -scores[n])  # higher score = picked earlier
    assert [kappa[n] for n in by_score] == sorted(kappa.values())
    assert targets == set(by_score[: max(1, int(len(kappa) * baselines.KAPPA_TOP_P))])


# ---------------------------------------------------------------------------
# The training loop's gradient is calibration's estimator, negated


def _reward(record, text):
    return float("3" in text.split())


def _prompts(n):
    return [PromptRecord(i, " ".join(str(2 + (i * 7 + j) % 60) for j in range(4)), None, {}) for i in range(n)]


class DemoTokenizer(TinyTokenizer):
    """TinyTokenizer that accepts add_special_tokens= (demonstration responses are tokenized without them)."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        return super().__call__(text)


def _batch_with_signal(task, prompts: int = 3):
    """The first seeded batch in which some reward varies within a prompt (else every signal is 0 and the
    gradient checks would compare zeros): a bounded, deterministic search."""
    for seed in range(50):
        batch = task.batch(prompts, Streams.from_seed(seed, "cpu"))
        if batch.rows_with_signal() > 0:
            return batch
    pytest.fail("no batch with a nonzero signal in 50 seeds: the reward never varies for this model")


def _grads(model):
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def test_on_policy_loss_gradient_is_minus_the_mean_signal_weighted_score():
    model, tok = tiny_model("llama-tied"), TinyTokenizer(64)
    task = make_task(RLObjective(_reward), Context(model, tok), _prompts(3), k=4, max_new_tokens=5)
    batch = _batch_with_signal(task)
    assert len(batch.rows) == 12 and [len(g) for g in batch.groups] == [4, 4, 4]
    model.zero_grad()
    backward(model, batch, task.pad, micro=5)  # micro-batches of 5, 5, 2 rows
    ids, mask, resp = pad_rows(batch.rows, task.pad, "cpu")
    signal = torch.tensor([float(w[0]) for w in batch.weights])  # a_n: the same on each of a row's tokens
    assert bool((signal != 0).any())
    _, weighted, _ = brute_force_sums(model, ids, mask, resp, signal=signal)
    for name, g in _grads(model).items():
        want = -weighted[name] / 12
        assert torch.allclose(g.double(), want, rtol=1e-4, atol=1e-7), name


def test_full_vocabulary_distillation_loss_gradient_is_plus_the_mean_token_weighted_score():
    """Token level: the loop descends sum_t A_t log pi(y_t|s_t); its gradient is
    +(1/B) sum_n sum_t A_{n,t} d log pi(y_t|s_t), checked against one backward per response token."""
    model, tok = tiny_model("llama-tied"), TinyTokenizer(64)
    objective = OPDFullObjective(Teacher(tiny_model("llama-tied", seed=1), name="teacher"))
    task = make_task(objective, Context(model, tok), _prompts(2), k=2, max_new_tokens=4)
    batch = task.batch(2, Streams.from_seed(0, "cpu"))
    assert len(batch.rows) == 4
    assert any(len(set(w.tolist())) > 1 for w in batch.weights)  # per-token signals, not one per row
    model.zero_grad()
    backward(model, batch, task.pad, micro=3)  # micro-batches of 3 and 1 rows
    want = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for row, a in zip(batch.rows, batch.weights):
        prompt, response = row.ids[: row.start], row.ids[row.start :]
        for a_t, h_t in zip(a.tolist(), per_token_scores(model, prompt, response)):
            for n in want:
                want[n] += a_t * h_t[n] / len(batch.rows)
    for name, g in _grads(model).items():
        assert torch.allclose(g.double(), want[name], rtol=1e-4, atol=1e-7), name


def test_demonstration_loss_gradient_is_minus_the_mean_demonstration_score(tmp_path):
    model, tok, prompts = tiny_model("llama-tied"), DemoTokenizer(64), _prompts(3)
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p.prompt, "response": f"{5 + i} 7"}) + "\n"
                             for i, p in enumerate(prompts)))
    task = make_task(SFTDemonstrationsObjective(demos), Context(model, tok), prompts, k=2, max_new_tokens=5)
    batch = task.batch(2, Streams.from_seed(0, "cpu"))  # min(3 rows, 2 x 2)
    assert len(batch.rows) == 3 and batch.weights is None
    model.zero_grad()
    backward(model, batch, task.pad, micro=2)
    _, _, total = brute_force_sums(model, *pad_rows(batch.rows, task.pad, "cpu"))
    for name, g in _grads(model).items():
        assert torch.allclose(g.double(), -total[name] / 3, rtol=1e-4, atol=1e-7), name


# ---------------------------------------------------------------------------
# The first-step check with the exact gradient (exact enumeration)


def _enumeration_reward(response):
    return 1.0 if 3 in response else (0.5 if response[:1] == [2] else 0.0)


def _exact_rl():
    """(P,) exact g = E_x E_y[(r - rbar) h] and S = E_x Var(r|x) over every response."""
    g, terms = 0.0, []
    for rows in en.student_outcomes():
        rbar = sum(o.prob * _enumeration_reward(o.response) for o in rows)
        terms.append(sum(o.prob * (_enumeration_reward(o.response) - rbar) ** 2 for o in rows))
        g = g + sum(o.prob * (_enumeration_reward(o.response) - rbar) * o.h for o in rows) / len(en.PROMPTS)
    return g, sum(terms) / len(terms)


def _unflatten(vector, model):
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = vector[start : start + p.numel()].reshape(p.shape).float()
        start += p.numel()
    return out


def test_first_step_with_the_exact_gradient_never_exceeds_the_exact_bound():
    model = en.student()
    g, scale = _exact_rl()
    bound = _unflatten((en.exact_fisher() * scale).sqrt(), model)
    grad = _unflatten(g, model)
    start = snapshot(model)
    lr = 1e-2
    for name, p in model.named_parameters():
        p.grad = -grad[name]  # the loss's gradient: SGD then moves by +lr g (ascent)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    delta = movement(model, start)
    assert max(float((delta[n] / lr - grad[n].abs()).abs().max()) for n in delta) < 1e-4  # |delta|/lr = |g|
    zeros = {n: torch.zeros_like(d) for n, d in delta.items()}
    check = first_step_check(delta, zeros, bound, start, lr)
    assert check["violation_rate"] == 0 and check["noise_violation_rate"] == 0
    assert 0.1 < check["max_ratio_to_bound"] <= 1 + 1e-4  # the bound holds, and is not vacuous
    # With half the bound, exactly the coordinates with |g| > bound / 2 are flagged (away from the edge).
    half = {n: b / 2 for n, b in bound.items()}
    flagged = first_step_check(delta, zeros, half, start, lr)["violation_rate"] * g.numel()
    ratio = torch.cat([(grad[n].abs() / half[n].clamp_min(1e-30)).reshape(-1) for n in grad])
    assert int((ratio > 1.001).sum()) <= flagged <= int((ratio > 0.999).sum())
    assert flagged > 0


def _enumeration_task(k: int):
    model, tok = en.student(), TinyTokenizer(en.VOCAB)
    objective = RLObjective(lambda record, text: _enumeration_reward([int(t) for t in text.split()]))
    return model, make_task(objective, Context(model, tok), en.records(), k=k, max_new_tokens=en.MAX_NEW)


def test_first_step_of_the_loop_estimates_the_exact_gradient_within_its_noise_level():
    """validate's first step (fresh samples, leave-one-out signal, two halves, one SGD step) on the
    enumerated model: |delta|/lr is the batch's mean gradient; averaged over independent batches it
    points along the exact g (unbiased), its squared error against g has the size of the squared noise
    estimate (same expectation; one batch's noise lives in few directions, so only within a factor 4
    over 8 batches), and with the exact bound, violations stay within what that noise explains."""
    model, task = _enumeration_task(k=16)
    g, scale = _exact_rl()
    exact_g, bound = _unflatten(g, model), _unflatten((en.exact_fisher() * scale).sqrt(), model)
    start, lr = snapshot(model), 1e-3
    err = level = 0.0
    average = {n: torch.zeros_like(t) for n, t in exact_g.items()}
    for seed in range(8):
        batch = task.batch(8, Streams.from_seed(seed, "cpu"))  # each prompt 4 times (prompts cycle in epochs)
        grad, noise, rows = split_half_gradient(model, batch, task.pad, micro=64)
        assert rows == len(batch.rows) == 128
        delta = sgd_step(model, grad, lr, start)
        assert all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())  # restored
        for n in delta:  # SGD moved by lr |g_hat|, up to the fp32 rounding of the new weight (one ulp)
            assert bool(((delta[n] - lr * grad[n].abs()).abs() <= spacing(start[n].abs() + delta[n])).all()), n
        # the loss gradient is -g_hat
        for n in grad:
            average[n] -= grad[n] / 8
        err += sum(float((-grad[n].double() - exact_g[n].double()).square().sum()) for n in grad)
        level += sum(float(noise[n].double().square().sum()) for n in noise)
        check = first_step_check(delta, noise, bound, start, lr)
        assert check["violation_rate"] <= 2 * check["noise_violation_rate"] + 0.02, check
    assert 0.25 < err / level < 4, (err, level)
    dot = sum(float((average[n].double() * exact_g[n].double()).sum()) for n in average)
    norms = [math.sqrt(sum(float(t[n].double().square().sum()) for n in t)) for t in (average, exact_g)]
    assert dot / (norms[0] * norms[1]) > 0.8  # noise of the average: about level / 64, against |g|^2 = 2.3


def test_adam_aware_snr_matches_a_brute_force_per_row_loop():
    """minibatch_snr from the engine's per-row sums equals |m| / sqrt(m^2 + Var/B) computed from every
    row's gradient of its signal-weighted log-probability, one backward per row (float64)."""
    model, tok = tiny_model("llama-tied"), TinyTokenizer(64)
    task = make_task(RLObjective(_reward), Context(model, tok), _prompts(3), k=4, max_new_tokens=5)
    batch = _batch_with_signal(task)
    sums = row_score_sums(model, batch, task.pad, micro=5)
    ids, mask, resp = pad_rows(batch.rows, task.pad, "cpu")
    per_row = per_sample_scores(model, ids, mask, resp, token_weights(batch.rows, batch.weights, ids.shape[1], "cpu"))
    live = 0
    for name in sums.total:
        u = torch.stack([r[name] for r in per_row])  # (12, *shape) per-row gradients a_n h_n
        m, var = u.mean(0), u.var(0, unbiased=False)
        for rows, population in ((4, None), (4, 12), (12, 12)):
            c = 1.0 if population is None else (population - rows) / (population - 1)
            denom = (m.square() + c * var / rows).sqrt()
            want = torch.where(denom > 0, m.abs() / denom.clamp_min(1e-300), 0.0)
            got = minibatch_snr(sums.total[name], sums.squares[name], sums.count, rows, population)
            assert torch.allclose(got.double(), want, atol=1e-4), (name, rows, population)
        live += int((m.abs() > 1e-6).sum())
        # the whole population as the minibatch: a deterministic gradient, SNR 1 wherever it is not 0
        full = minibatch_snr(sums.total[name], sums.squares[name], sums.count, 12, 12)
        assert bool((full[m.abs() > 1e-6] > 0.999).all())
    assert live > 0


# ---------------------------------------------------------------------------
# End to end on tiny models


@pytest.fixture(scope="module")
def rl_setup():
    model, tok, prompts = tiny_model("llama-tied"), TinyTokenizer(64), _prompts(6)
    objective = RLObjective(_reward)
    cal = calibrate(model, tok, prompts[:4], objective, samples_per_prompt=8, max_new_tokens=5, seed=0,
                    progress=False)
    run = make_run(cal.fisher, objectives=[{"name": "rl", "signal_scale": cal.signal_scale}])
    return run, Setup(model, tok, objective, prompts[:4], prompts[4:], True)


SMALL = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=5, progress=False)


def test_validate_end_to_end_writes_json_and_plots_and_restores_the_model(rl_setup, tmp_path):
    run, setup = rl_setup
    before = snapshot(setup.model)
    out = tmp_path / "val"
    result = validate(run, 2, "sgd", 0.05, seed=0, setup=setup, out=out,
                      config=ValidationConfig(subsample=3000, mask_densities=(0.1,)), **SMALL)
    assert {p.name for p in out.iterdir()} == {"validation.json", "bound_vs_movement.png", "precision_at_k.png",
                                               "objective_per_step.png"}
    report = json.loads((out / "validation.json").read_text())
    for key in ("auroc", "precision_at_k", "recall_at_k", "spearman_modules", "jaccard_at_k",
                "first_step_violation_rate", "training_outcome", "baselines", "adam_aware"):
        assert key in report, key
    assert set(report["baselines"]) == {"random", "magnitude", "single_batch_gradient", "spectrum_snr", "kappa",
                                        "second_seed"}
    for entry in [report, report["adam_aware"], *report["baselines"].values()]:
        assert all(v is None or 0 <= v <= 1 for v in entry["auroc"].values())
        assert all(0 <= v <= 1 for v in entry["precision_at_k"].values())
    assert report["subsample"]["coordinates"] == 3000 and report["subsample"]["of"] == run_numel(run)
    assert {"bound_mass", "fisher_mass", "chosen"} <= set(report["spearman_modules"])
    assert 0 <= report["first_step_violation_rate"] <= 1
    assert len(report["training_outcome"]["runs"]["main"]["per_step"]) == 2
    # the prediction after each step; after the last step it is the report's own AUROC (same movement)
    by_step = report["auroc_by_step"]
    assert all(len(by_step[f"q{q}"]) == 2 for q in (0.99, 0.9))
    assert by_step["q0.99"][-1] == report["auroc"]["q0.99"] and by_step["q0.9"][-1] == report["auroc"]["q0.9"]
    check_masked(report, run, setup.model)
    assert report["movement_summary"]["main"]["l2_norm"] > 0
    after = snapshot(setup.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # validate leaves the model as it found it
    assert result.report["run_id"] == run.run_id
    with pytest.raises(FisherSelectError, match="already"):  # refused before any training
        validate(run, 2, "sgd", 0.05, setup=setup, out=out, **SMALL)


def check_masked(report, run, model):
    """Masked fine-tuning: fisher / random / magnitude at exactly 10% of the coordinates, Spectrum's choice
    at its own density, each share = (after - before) / (full - before) of the report's own numbers."""
    outcome = report["training_outcome"]
    masked = outcome["masked_fine_tuning"]
    full, start = masked["full_fine_tuning"], masked["before"]
    assert full == outcome["runs"]["main"]["held_out_after"] and start == outcome["held_out_before"]
    runs = {r["mask"]: r for r in masked["runs"]}
    assert set(runs) == {"fisher", "random", "magnitude", "spectrum"}
    total = run_numel(run)
    for rule in ("fisher", "random", "magnitude"):  # the same budget
        assert runs[rule]["trainable"] == top_count(0.1, total)
        assert runs[rule]["density"] == pytest.approx(0.1, abs=1e-3)
    chosen = baselines.spectrum_selection(baselines.spectrum_module_scores(model))
    spectrum = sum(p.numel() for n, p in model.named_parameters() if module_of(n) in chosen)
    assert runs["spectrum"]["trainable"] == spectrum and runs["spectrum"]["density"] == spectrum / total
    seeds = masked["seeds"]
    fulls = dict(zip(seeds, masked["full_fine_tuning_per_seed"]))
    assert fulls[seeds[0]] == full
    if len(seeds) > 1 and "second_seed" in outcome["runs"]:  # the second-seed run is reused, not rerun
        assert fulls[seeds[1]] == outcome["runs"]["second_seed"]["held_out_after"]
    for r in masked["runs"]:  # full fine-tuning that changed nothing (e.g. a constant reward) has no share
        assert [e["seed"] for e in r["per_seed"]] == seeds
        for e in r["per_seed"]:  # each seed's share against full fine-tuning with the same seed
            f = fulls[e["seed"]]
            assert e["full_fine_tuning"] == f
            assert e["recovered"] == (None if f == start else pytest.approx((e["after"] - start) / (f - start)))
        shares = [e["recovered"] for e in r["per_seed"]]
        assert r["after"] == pytest.approx(sum(e["after"] for e in r["per_seed"]) / len(seeds))
        if None in shares:
            assert r["recovered"] is None
            continue
        assert r["recovered"] == pytest.approx(sum(shares) / len(shares))
        if len(seeds) > 1:
            assert (r["recovered_spread"]["min"], r["recovered_spread"]["max"]) == (min(shares), max(shares))
    assert "recovered" in "\n".join(summary_lines(report))
    return full, start


def run_numel(run):
    return sum(f.numel() for f in run.fisher.values())


def test_same_seed_reproduces_the_validation(rl_setup):
    run, setup = rl_setup
    opts = ValidationConfig(subsample=2000, second_seed=False, adam_aware=False)
    a = validate(run, 1, "adamw", 1e-3, weight_decay=0.1, seed=3, setup=setup, config=opts, **SMALL).report
    b = validate(run, 1, "adamw", 1e-3, weight_decay=0.1, seed=3, setup=setup, config=opts, **SMALL).report
    assert a["auroc"] == b["auroc"] and a["training_outcome"]["runs"] == b["training_outcome"]["runs"]
    assert any("AdamW" in c for c in a["caveats"]) and any("weight decay" in c for c in a["caveats"])


def test_validate_sft_from_demonstrations_end_to_end(tmp_path):
    model, tok, prompts = tiny_model("llama-untied"), DemoTokenizer(64), _prompts(5)
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p.prompt, "response": f"{5 + i} 7"}) + "\n"
                             for i, p in enumerate(prompts)))
    objective = SFTDemonstrationsObjective(demos)
    cal = calibrate(model, tok, prompts[:3], objective, samples_per_prompt=4, max_new_tokens=4, progress=False)
    run = make_run(cal.fisher, objectives=[{"name": "sft", "signal_scale": None}])
    setup = Setup(model, tok, SFTDemonstrationsObjective(demos), prompts[:3], prompts[3:], True)
    options = ValidationConfig(subsample=2000, mask_densities=(0.1,), mask_seeds=2)
    # minibatches of 2 of the 3 demonstrations: the seed decides which, so seeds differ
    report = validate(run, 2, "sgd", 0.1, setup=setup, config=options, **(SMALL | {"prompts_per_step": 2, "samples_per_prompt": 1})).report
    full, start = check_masked(report, run, model)
    runs = {r["mask"]: r for r in report["training_outcome"]["masked_fine_tuning"]["runs"]}
    # two seeds train on different minibatches: the spread is real, not one run reported twice
    assert len({e["after"] for e in runs["fisher"]["per_seed"]}) == 2
    assert "over seeds" in "\n".join(summary_lines(report))
    assert full < start  # full fine-tuning lowered the held-out loss: every share above is a real division
    assert report["first_step_violation_rate"] is None and "unknown" in report["first_step"]["reason"]
    outcome = report["training_outcome"]
    assert outcome["held_out_before"] > 0 and "negative log-likelihood" in outcome["held_out_metric"]
    assert outcome["runs"]["main"]["per_step"][1]["outcome"] < outcome["runs"]["main"]["per_step"][0]["outcome"]
    assert report["auroc"]["q0.99"] is not None
    # F is objective-independent, but an RL run's S says nothing about SFT: no absolute bound then
    rl_run = make_run(cal.fisher, objectives=[{"name": "rl", "signal_scale": 0.5}])
    opts = ValidationConfig(subsample=2000, second_seed=False, adam_aware=False)
    other = validate(rl_run, 1, "sgd", 0.1, setup=setup, config=opts, **SMALL).report
    assert other["first_step_violation_rate"] is None and "belongs to its 'rl'" in other["first_step"]["reason"]


def test_cli_validate_on_a_calibrated_run_directory(tmp_path, small_llama_dir, capsys):
    """calibrate then validate through the CLI: the recipe (SFT from demonstrations, so a random model
    still gets a training signal), model and prompts come from report.json."""
    from fisher_select.cli import main

    run_dir = tmp_path / "run"
    assert main(["calibrate", "--recipe", "sft-demonstrations", "--model", str(small_llama_dir), "--out", str(run_dir),
                 "--num-prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["validate", str(run_dir), "--steps", "1", "--lr", "1e-3", "--prompts-per-step", "2",
                 "--samples-per-prompt", "2", "--subsample", "5000", "--eval-prompts", "2", "--no-second-seed",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "fisher (F / bound)" in printed and "spectrum_snr" in printed
    report = json.loads((run_dir / "validation-sgd-seed0" / "validation.json").read_text())
    assert report["settings"]["max_new_tokens"] == 4 and report["training_outcome"]["held_out_disjoint"]
    assert report["objective"]["type"] == "sft" and report["first_step_violation_rate"] is None
    assert np.isfinite(report["auroc"]["q0.9"]) and report["movement_summary"]["main"]["max"] > 0
    # the run's pages were redrawn with a Validation section holding this validation's numbers
    markdown = (run_dir / "report.md").read_text()
    assert "## Validation against training" in markdown and "validation-sgd-seed0" in markdown
    assert f"| {report['auroc']['q0.99']:.2f} |" in markdown
    assert "Validation against training" in (run_dir / "report.html").read_text()


def test_report_validation_section_rows_and_plain_failure_sentence():
    from fisher_select.report import validation_section as section

    def fake(auc, optimizer):
        entry = {"auroc": {"q0.99": auc}}
        return {"objective": {"type": "rl"}, "settings": {"optimizer": optimizer, "lr": 1e-4, "weight_decay": 0.0,
                                                          "steps": 4, "prompts_per_step": 4, "samples_per_prompt": 4},
                **entry, "precision_at_k": {"0.01": 0.25}, "adam_aware": {"auroc": {"q0.99": 0.7}},
                "baselines": {k: entry for k, _ in section.BASELINES},
                "spearman_modules": {"sum_sqrt_fisher": 0.9, "sum_fisher": 0.1},
                "first_step": {"violation_rate": 0.001, "noise_violation_rate": 0.002}, "caveats": ["c"]}

    pairs = [("validation-sgd", fake(0.93, "sgd")), ("validation-adamw", fake(0.51, "adamw"))]
    rows = section.rows(pairs)
    assert len(rows) == 2 and all(len(r) == len(section.HEADER) for r in rows)
    assert rows[0][2] == "0.93" and rows[0][-3:] == ["0.90", "0.10", "1.0e-03 (2.0e-03)"]
    said = section.findings(pairs)
    assert sum("does NOT predict" in f for f in said) == 1 and "validation-adamw" in said[1]
    assert section.markdown_lines([]) == [] and section.html_section([]) == ""


def test_a_validation_json_of_the_old_format_still_loads_and_renders(tmp_path):
    """Format 1 (no format_version) named the module aggregates sum_sqrt_fisher / sum_fisher."""
    from fisher_select.report import validation_section as section
    from fisher_select.run.validation import VALIDATION_FORMAT_VERSION, ValidationRecord, load_validations

    old = {"run_id": "r", "model": "m", "objective": {"name": "rl", "type": "rl"},
           "auroc": {"q0.99": 0.93, "q0.9": 0.8},
           "precision_at_k": {"0.01": 0.25}, "spearman_modules": {"sum_sqrt_fisher": 0.9, "sum_fisher": 0.1,
                                                                  "chosen": "sum_sqrt_fisher"},
           "module_table": [{"module": "a", "sum_fisher": 2.0, "sum_sqrt_fisher": 1.5, "movement": 0.1}],
           "first_step_violation_rate": None, "first_step": {"violation_rate": None, "reason": "why"},
           "baselines": {}, "adam_aware": {}, "training_outcome": {}, "caveats": ["c"]}
    folder = tmp_path / "run" / "validation-sgd-seed0"
    folder.mkdir(parents=True)
    (folder / "validation.json").write_text(json.dumps(old))
    [(name, record)] = load_validations(tmp_path / "run")
    assert name == "validation-sgd-seed0" and record.format_version == VALIDATION_FORMAT_VERSION
    assert record.spearman_modules == {"bound_mass": 0.9, "fisher_mass": 0.1, "chosen": "bound_mass"}
    assert record.module_table == [{"module": "a", "fisher_mass": 2.0, "bound_mass": 1.5, "movement": 0.1}]
    assert record.metrics["auroc"] == {"q0.99": 0.93, "q0.9": 0.8} and record.first_step_violation_rate is None
    assert section.rows([(name, record)])[0][-3:] == ["0.90", "0.10", "n/a (no S for the trained objective)"]
    written = record.to_json()  # written again: this format, the new names, the metrics at the top level
    assert written["format_version"] == VALIDATION_FORMAT_VERSION and written["auroc"] == old["auroc"]
    assert "sum_sqrt_fisher" not in json.dumps(written) and ValidationRecord.from_json(written) == record


def test_first_step_check_refuses_an_estimated_zero_signal_scale(rl_setup):
    """S estimated 0 (no calibration prompt's reward varied) would make the bound 0 everywhere: no check."""
    run, setup = rl_setup
    zero = make_run(run.fisher, objectives=[{"name": "rl", "signal_scale": 0.0}])
    opts = ValidationConfig(subsample=2000, second_seed=False, adam_aware=False)
    report = validate(zero, 1, "sgd", 0.05, setup=setup, config=opts, **SMALL).report
    assert report["first_step_violation_rate"] is None
    assert "estimated signal scale S is 0" in report["first_step"]["reason"]


def test_bad_validation_options_are_listed_in_one_error_before_training(rl_setup):
    run, setup = rl_setup
    before = snapshot(setup.model)
    bad = ValidationConfig(subsample=10, first_step_prompts=1, mask_densities=(0.0, 1.5), mask_seeds=0)
    with pytest.raises(FisherSelectError) as err:
        validate(run, 1, "sgd", 0.1, setup=setup, config=bad, **SMALL)
    message = str(err.value)
    for part in ("subsample must be at least 100", "first_step_prompts must be at least 2",
                 "mask density 0.0 is not in (0, 1)", "mask density 1.5", "mask_seeds must be at least 1"):
        assert part in message, part
    assert all(torch.equal(before[n], t) for n, t in snapshot(setup.model).items())


def test_bf16_lost_counts_updates_below_half_a_bf16_spacing():
    """bf16 keeps 8 significant bits: at 1.0 the spacing is 2^-7, so an update below 2^-8 rounds away;
    at 0 every tiny update survives (bf16 has fp32's exponent range)."""
    model = torch.nn.Linear(5, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0, 0.0, 3.0, -2.0]]))
    start = snapshot(model)
    with torch.no_grad():  # lost, kept, kept (at 0), unmoved, lost (-2.003: the spacing beyond 2 is 2^-6)
        model.weight.add_(torch.tensor([[0.003, 0.005, 1e-30, 0.0, -0.003]]))
    assert bf16_lost(model, start) == (4, 2)
    moved = model.weight.detach() - start["weight"]
    direct = ((start["weight"].bfloat16().float() + moved).bfloat16() == start["weight"].bfloat16()) & (moved != 0)
    assert int(direct.sum()) == 2


def test_masked_fine_tuning_through_the_sparse_mode_gives_the_dense_results(tmp_path):
    model, tok, prompts = tiny_model("llama-untied"), DemoTokenizer(64), _prompts(5)
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": p.prompt, "response": f"{5 + i} 7"}) + "\n"
                             for i, p in enumerate(prompts)))
    cal = calibrate(model, tok, prompts[:3], SFTDemonstrationsObjective(demos), samples_per_prompt=4,
                    max_new_tokens=4, progress=False)
    run = make_run(cal.fisher, objectives=[{"name": "sft", "signal_scale": None}])
    reports = {}
    for sparse in (False, True):
        setup = Setup(model, tok, SFTDemonstrationsObjective(demos), prompts[:3], prompts[3:], True)
        options = ValidationConfig(subsample=2000, mask_densities=(0.1,), second_seed=False, adam_aware=False,
                                   sparse_masks=sparse)
        reports[sparse] = validate(run, 2, "adamw", 1e-2, weight_decay=0.1, setup=setup, config=options,
                                   **(SMALL | {"prompts_per_step": 2, "samples_per_prompt": 1})).report
    dense, sparse = (reports[k]["training_outcome"]["masked_fine_tuning"] for k in (False, True))
    assert dense["mode"].startswith("dense") and sparse["mode"].startswith("sparse")
    for a, b in zip(dense["runs"], sparse["runs"]):
        assert a["mask"] == b["mask"] and a["trainable"] == b["trainable"]
        assert b["after"] == pytest.approx(a["after"], rel=1e-4)
        assert a["after"] != dense["before"]  # the masked runs trained
