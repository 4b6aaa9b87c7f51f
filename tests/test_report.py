"""The report's statistics against known answers, the calibration's split halves, and the pages.

Known answers: synthetic scores with zero / nonzero mean and heavy tails (score-mean check),
identical / independent halves (split-half), samples of a tiny model drawn from it vs at
temperature 1.5, and the S interval's coverage of the exact S of an enumerable model.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.objectives import Group, RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.calibration.sampling import left_pad, sample_responses
from fisher_select.engine.reference import enumerate_responses
from fisher_select.engine.scoring import score_sums
from fisher_select.models import fingerprint
from fisher_select.report.compare import compare
from fisher_select.report.statistics import ReportStatistics, module_spread, scale_uncertainty
from fisher_select.report.text import run_summary_lines as summary_lines
from fisher_select.report.warnings import run_warnings
from fisher_select.report.build import build_report, regenerate, write_run_with_pages
from fisher_select.run.load import load_run
from fisher_select.run.schema import ModelInfo
from fisher_select.stats.conformity import CONSISTENT, OFF_POLICY, expected_abs_z, score_mean_conformity
from fisher_select.stats.naming import module_of
from fisher_select.stats.stability import (MORE_PROMPTS, STABLE, SplitHalf, compare_halves, spearman_brown_prompts,
                                          suggested_prompts)
from tests.tiny import TinyTokenizer, enumeration_model, tiny_model

# ---------------------------------------------------------------------------
# Score-mean check: synthetic scores with known means


def _moments(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h: (n, P) per-sample scores -> (mean h^2, mean h) as calibrate computes them."""
    return h.square().mean(0), h.mean(0)


def test_score_mean_check_on_synthetic_scores_with_known_means():
    g = torch.Generator().manual_seed(0)
    n, p = 200, 20000
    centred = torch.randn(n, p, generator=g, dtype=torch.float64)
    f, m = _moments(centred)
    ok = score_mean_conformity({"w": f}, {"w": m}, n, set())
    share, median = expected_abs_z(n)
    assert abs(ok.all.share_above - share) < 0.002 and abs(ok.all.median_abs_z - median) < 0.03
    assert ok.verdict == CONSISTENT and not ok.heavy_tails
    f, m = _moments(centred + 0.3)  # E[h] = 0.3 sd: z about 0.3 sqrt(200) = 4.2
    biased = score_mean_conformity({"w": f}, {"w": m}, n, set())
    assert biased.verdict == OFF_POLICY and biased.all.share_above > 0.5


def test_heavy_tailed_embedding_scores_inflate_z_and_the_robust_version_says_so():
    """An embedding row: -c on most samples, a large jump on the rare sample of its token (mean 0)."""
    g = torch.Generator().manual_seed(1)
    n, rows = 64, 4000
    p = 0.004  # the token's probability: usually never sampled in 64 samples
    hit = torch.rand(n, rows, generator=g) < p
    heavy = torch.where(hit, torch.tensor(1 - p), torch.tensor(-p)).double() * (1 + 0.1 * torch.randn(n, rows,
                                                                                                    generator=g))
    dense = torch.randn(n, 8000, generator=g, dtype=torch.float64)
    (fh, mh), (fd, md) = _moments(heavy), _moments(dense)
    out = score_mean_conformity({"embed.weight": fh, "mlp.weight": fd}, {"embed.weight": mh, "mlp.weight": md}, n,
                                {"embed.weight"})
    assert out.all.ratio > 3 and out.robust.ratio < 2 and out.all.rms_z > 3
    assert out.heavy_tails and out.verdict == CONSISTENT and "heavy-tailed" in out.message


class _Tempered(nn.Module):
    """The model's logits divided by a temperature: samples that do not follow the model."""

    def __init__(self, inner: nn.Module, temperature: float):
        super().__init__()
        self.inner, self.temperature, self.config = inner, temperature, inner.config

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits / self.temperature
        return out


def _check_samples(model, sampler, prompts=64, k=4, max_new=8):
    """Score samples drawn by ``sampler`` under ``model``; the score-mean check of them."""
    g = torch.Generator().manual_seed(0)
    rows = [p for p in [torch.randint(2, 64, (4,), generator=g).tolist() for _ in range(prompts)] for _ in range(k)]
    drawn = sample_responses(sampler, rows, eos_ids={1}, pad_id=1, max_new_tokens=max_new, generator=g)
    ids, mask = left_pad([r + s.response_ids for r, s in zip(rows, drawn)], 1, "cpu")  # (B, T)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    for b, s in enumerate(drawn):
        resp[b, ids.shape[1] - len(s.response_ids):] = True
    sums = score_sums(model, ids, mask, resp)
    n = sums.count
    heavy = {"model.embed_tokens.weight", "lm_head.weight"}
    return score_mean_conformity({k_: v / n for k_, v in sums.squares.items()},
                                 {k_: v / n for k_, v in sums.total.items()}, n, heavy)


def test_score_mean_check_passes_samples_from_the_model_and_flags_temperature_1_5():
    model = tiny_model("llama-untied")
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked next-token distributions: tempering changes them
    on = _check_samples(model, model)
    off = _check_samples(model, _Tempered(model, 1.5))
    assert on.verdict == CONSISTENT and on.robust.ratio < 2, on.message
    assert off.verdict == OFF_POLICY and off.robust.ratio > 5, off.message


# ---------------------------------------------------------------------------
# Split halves and the spread


def test_identical_halves_are_stable_and_independent_halves_are_not():
    g = torch.Generator().manual_seed(0)
    f = {f"m{i}.weight": torch.rand(50, 40, generator=g) ** 4 * (i + 1) for i in range(12)}
    same = compare_halves(f, {k: v.clone() for k, v in f.items()}, [40, 40], [10, 10])
    assert same.spearman_bound_mass == pytest.approx(1.0) and same.jaccard == [1.0, 1.0]
    assert same.verdict == STABLE
    noise = {k: torch.rand(v.shape, generator=g) for k, v in f.items()}
    other = compare_halves(noise, {k: torch.rand(v.shape, generator=g) for k, v in f.items()}, [40, 40], [10, 10])
    # independent random top-f masks overlap by f / (2 - f) in expectation
    assert other.jaccard[0] == pytest.approx(0.01 / 1.99, abs=0.01)
    assert other.jaccard[1] == pytest.approx(0.1 / 1.9, abs=0.01)
    assert abs(other.spearman_bound_mass) < 0.7 and other.verdict == MORE_PROMPTS


def test_spearman_brown_suggestion():
    assert spearman_brown_prompts(0.5, 10) == 90  # k = 0.9 * 0.5 / (0.5 * 0.1) = 9
    assert spearman_brown_prompts(0.95, 10) == 10 and spearman_brown_prompts(-0.1, 10) is None


def test_suggested_prompts_exceed_the_current_count_whenever_a_threshold_falls_short():
    # the module ranking agrees already (0.95 >= 0.9) but the top-10% masks do not (0.3 < 0.5):
    # Spearman-Brown on the Jaccard, k = 0.5 * 0.7 / (0.3 * 0.5) = 7/3, so ceil(16 * 7/3) = 38
    assert suggested_prompts(0.95, 0.3, 16) == 38
    assert suggested_prompts(0.5, 0.6, 10) == 90  # the Spearman falls short: its projection, as before
    assert suggested_prompts(0.5, 0.1, 10) == 90  # both short: the larger (Jaccard: k = 9, also 90)
    assert suggested_prompts(0.5, 0.05, 10) == 190  # Jaccard k = 0.95 / 0.05 = 19
    assert suggested_prompts(0.95, 0.6, 16) == 16  # stable: no more needed
    assert suggested_prompts(0.95, 0.0, 16) is None and suggested_prompts(None, 0.6, 16) is None  # no trend
    for rho, top10 in ((0.9, 0.4999), (0.8999, 0.5), (0.2, 0.9)):  # just short: still strictly more
        assert suggested_prompts(rho, top10, 16) > 16


def _with_split_half(run, rho: float, top10: float, suggested: int | None):
    stats = ReportStatistics.from_json(run.report.statistics)
    stats.stability = SplitHalf([8, 8], [64, 64], rho, rho, [0.01, 0.1], [0.1, top10], MORE_PROMPTS, suggested, "m")
    run.report.statistics = stats.to_json()
    return summary_lines(run.report)[2]


def test_verdict_advises_more_prompts_than_the_run_has(tiny_runs):
    """A 16-prompt run whose masks disagree was told "about 16 in all"; the count comes from the halves' trend."""
    run = load_run(tiny_runs[0])
    advice = _with_split_half(run, 0.95, 0.3, suggested_prompts(0.95, 0.3, 16))
    assert "calibrate on more prompts (about 38 in all, 22 more)" in advice
    # a report written by an older release suggested the count it had: no count rather than a wrong one
    advice = _with_split_half(run, 0.95, 0.3, 16)
    assert "calibrate on more prompts: the split halves" in advice and "16 in all" not in advice


def test_module_spread_is_the_ratio_estimator_standard_error():
    names = ["a.weight", "a.bias", "b.weight"]
    counts = [4, 4, 8]
    masses = [[2.0, 2.0, 1.0], [4.0, 0.0, 1.0], [12.0, 0.0, 2.0]]  # b: mass exactly proportional to counts
    out = module_spread(names, masses, counts)
    assert out["b"] == pytest.approx(0.0, abs=1e-12)
    m = np.array([4.0, 4.0, 12.0])
    n = np.array(counts, dtype=float)
    f = m.sum() / n.sum()
    want = math.sqrt(((m - f * n) ** 2).sum() / (3 * 2 * n.mean() ** 2)) / f
    assert out["a"] == pytest.approx(want)


def _tiny_calibration(seed=0, stability=True, prompts=8, k=2, model=None):
    model = model or tiny_model("llama-tied")
    records = [PromptRecord(i, f"{2 + i} {5 + 3 * i % 50} 7", None, {}) for i in range(prompts)]
    cal = calibrate(model, TinyTokenizer(64), records, RLObjective(lambda r, t: float("9" in t.split()[:3])),
                    samples_per_prompt=k, max_new_tokens=4, seed=seed, batch_size=8, progress=False,
                    stability=stability)
    return model, cal


@pytest.fixture(scope="module")
def cals():
    """(model, calibration) of seeds 0 and 1, shared by the tests below (calibrations are the slow part)."""
    return [_tiny_calibration(seed=seed) for seed in (0, 1)]


def test_split_halves_are_the_exact_fisher_of_each_half_and_change_nothing_else(cals):
    model, cal = cals[0]
    _, plain = _tiny_calibration(stability=False)
    for name in cal.fisher:  # the same sums in another order: fp32 rounding apart (g cancels: scale atol)
        assert torch.allclose(cal.fisher[name], plain.fisher[name], rtol=1e-5, atol=1e-10), name
        g, want = cal.grad_estimate[name], plain.grad_estimate[name]
        assert torch.allclose(g, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), name
    assert cal.signal_scale == plain.signal_scale and plain.diagnostics.split_half is None
    split = cal.diagnostics.split_half
    assert split.prompts == [4, 4] and split.samples == [8, 8]
    for half in (0, 1):  # rescore each half's samples by hand: their module sums of sqrt(F)
        rows = [s for s in cal.samples if s["prompt_index"] % 2 == half]
        ids, mask = left_pad([s["prompt_ids"] + s["response_ids"] for s in rows], 1, "cpu")
        resp = torch.zeros_like(ids, dtype=torch.bool)
        for b, s in enumerate(rows):
            resp[b, ids.shape[1] - len(s["response_ids"]):] = True
        sums = score_sums(model, ids, mask, resp)
        want = {}
        for name, sq in sums.squares.items():
            want[module_of(name)] = want.get(module_of(name), 0.0) + float((sq / len(rows)).sqrt().double().sum())
        got = {m: v[half] for m, v in zip(split.modules, split.module_bound_mass)}
        for m in want:
            assert got[m] == pytest.approx(want[m], rel=1e-4), m
    assert sum(cal.diagnostics.unit_counts) == cal.num_samples


# ---------------------------------------------------------------------------
# The interval of S covers the exact S


def _population():
    """Prompts of the enumerable model with their exact outcome distributions and Var(r | x)."""
    model = enumeration_model()
    out = []
    for prompt in ([2, 3], [4, 2, 0], [3, 3], [0, 4]):
        outcomes = enumerate_responses(model, prompt, {1}, 3)
        probs = np.array([o.prob for o in outcomes])
        rewards = np.array([float(3 in o.response) for o in outcomes])
        out.append((prompt, outcomes, probs / probs.sum(), float(probs @ rewards**2 - (probs @ rewards) ** 2)))
    return out


def _terms(population, rng, prompts: int, k: int) -> list[float]:
    """Per-prompt scale terms of RLObjective for prompts drawn from the population, K exact samples each."""
    objective = RLObjective(lambda record, text: float("3" in text.split()))
    stats = objective.new_statistics()
    for i in rng.integers(0, len(population), prompts):
        prompt, outcomes, probs, _ = population[i]
        picked = [outcomes[j].response for j in rng.choice(len(outcomes), k, p=probs)]
        texts = [" ".join(map(str, r)) for r in picked]
        group = Group(PromptRecord(int(i), "", None, {}), prompt, picked, texts, [0.0] * k, [True] * k)
        stats.add(objective.signals(group, None))
    return stats.terms


def test_scale_interval_covers_the_exact_scale_at_its_nominal_rate():
    """200 repetitions of 32 prompts x 4 exact samples: BCa coverage in [0.90, 0.99] (nominal 0.95; one
    binomial standard deviation is 0.015; measured here 0.95, and 0.85 with 8 prompts); the t interval,
    which ignores the terms' skew, in [0.85, 0.99] (measured 0.90)."""
    population = _population()
    exact = float(np.mean([v for *_, v in population]))
    rng = np.random.default_rng(0)
    hits = {"bootstrap": 0, "t": 0}
    reps = 200
    for rep in range(reps):
        u = scale_uncertainty("rl", _terms(population, rng, 32, 4), seed=rep)
        hits["bootstrap"] += u.bootstrap_interval[0] <= exact <= u.bootstrap_interval[1]
        hits["t"] += u.t_interval[0] <= exact <= u.t_interval[1]
    assert 0.90 <= hits["bootstrap"] / reps <= 0.99, hits
    assert 0.85 <= hits["t"] / reps <= 0.99, hits


def test_report_interval_is_that_of_the_calibrations_own_terms(cals):
    _, cal = cals[0]
    report = _report(cal)
    u = ReportStatistics.from_json(report.statistics).uncertainty[0]
    assert u.scale_terms == cal.diagnostics.scale_terms[0] and u.num_prompts == 8
    assert u.signal_scale == pytest.approx(cal.signal_scale)
    again = scale_uncertainty("rl", cal.diagnostics.scale_terms[0])
    assert u.bootstrap_interval == again.bootstrap_interval and u.t_interval == again.t_interval


# ---------------------------------------------------------------------------
# Report files: JSON, summary, warnings, HTML, regeneration, comparison


def _report(cal, seed=0):
    model = tiny_model("llama-tied")
    info = ModelInfo("tiny", fingerprint(model), None, None, None, None)
    return build_report(cal, model=info, recipe=None, recipe_name=None, sampling={"temperature": 1.0},
                        settings={"samples_per_prompt": 2, "max_new_tokens": 4, "seed": seed})


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, cals):
    root = tmp_path_factory.mktemp("report")
    paths = []
    for seed, (_, cal) in enumerate(cals):
        paths.append(write_run_with_pages(root / f"seed{seed}", cal, _report(cal, seed), overwrite=False))
    return paths


PLOTS = {"scales", "modules", "bounds", "heatmap", "layers", "cumulative", "histogram", "ratios", "conformity",
         "stability", "signals"}  # every figure plots.all_plots draws for a run with one RL objective


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href", "srcset", "data", "poster") and v]


def test_html_is_one_self_contained_file_with_every_plot(tiny_runs):
    from PIL import Image

    text = (tiny_runs[0] / "report.html").read_text()
    parser = _Refs()
    parser.feed(text)
    assert parser.refs and all(r.startswith("data:image/png;base64,") for r in parser.refs)
    assert not {"script", "link", "iframe", "object"} & set(parser.tags) and "url(" not in text
    keys = set(re.findall(r'<figure id="(\w+)"', text))
    assert keys == PLOTS and len(parser.refs) == len(PLOTS)
    for ref in parser.refs:
        image = Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1])))
        image.verify()
        assert image.size[0] > 300 and image.size[1] > 200
    assert text.index("do not promise") < text.index("Warnings") < text.index("<h2>Run</h2>")


def test_report_json_markdown_and_summary(tiny_runs):
    data = json.loads((tiny_runs[0] / "report.json").read_text())
    stats = ReportStatistics.from_json(data["statistics"])
    assert stats.conformity is not None and stats.stability is not None and stats.concentration is not None
    assert [b.objective for b in stats.bound_ratios] == ["rl"] and stats.signals[0].value_label == "reward"
    assert all(m["bound_mass"] > 0 for m in data["modules"])
    md = (tiny_runs[0] / "report.md").read_text()
    assert md.index("do not promise") < md.index("## Objectives") and "sum of sqrt(F)" in md
    report = load_run(tiny_runs[0]).report
    short, full = summary_lines(report), summary_lines(report, top=None)
    assert short[3].startswith("Outcome study") and short[4].startswith("Caveat:")  # right after the verdict
    assert "--all" in "\n".join(short)
    assert len(full) - len(short) == len(report.modules) - 15


def test_off_policy_verdict_becomes_a_warning(tiny_runs):
    report = load_run(tiny_runs[0]).report
    report.statistics["conformity"]["verdict"] = OFF_POLICY
    report.statistics["conformity"]["message"] = "0.9% of coordinates have |z| > 3"
    assert any(w.startswith("score-mean check: 0.9%") for w in run_warnings(report))


@pytest.mark.parametrize("recompute", [False, True])
def test_report_command_regenerates_the_same_report(tiny_runs, tmp_path, recompute):
    copy = shutil.copytree(tiny_runs[0], tmp_path / "copy")
    before = (copy / "report.json").read_text()
    (copy / "report.html").unlink()
    written = regenerate(copy, recompute=recompute)
    assert {p.name for p in written} == {"report.json", "report.md", "report.html"}
    assert (copy / "report.json").read_text() == before and (copy / "report.html").is_file()


def test_redrawing_the_report_reads_no_tensor(tiny_runs, tmp_path, monkeypatch):
    import fisher_select.report.build as build
    import fisher_select.run.load as run_load

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor file was read")

    copy = shutil.copytree(tiny_runs[0], tmp_path / "copy")
    monkeypatch.setattr(run_load, "read_tensors", refuse)
    monkeypatch.setattr(build, "read_tensors", refuse)
    assert (copy / "report.html") in regenerate(copy)
    with pytest.raises(AssertionError, match="tensor file was read"):
        regenerate(copy, recompute=True)


def test_compare_two_seeds(tiny_runs):
    same = compare([tiny_runs[0], tiny_runs[0]])
    assert same.pairs[0].jaccard == [1.0, 1.0] and same.pairs[0].spearman_bound_mass == pytest.approx(1.0)
    seeds = compare(tiny_runs)
    pair = seeds.pairs[0]
    assert pair.comparable and all(0 < j < 1 for j in pair.jaccard) and pair.spearman_bound_mass > 0.5
    assert [r["seed"] for r in seeds.runs] == [0, 1]


CHROMIUM = Path("/usr/bin/chromium")
# .ci/run installs Debian's chromium and sets this, so in CI a missing browser fails instead of skipping.
REQUIRE_BROWSER = os.environ.get("FISHER_SELECT_REQUIRE_BROWSER") == "1"
NO_BROWSER = (f"report.html NOT tested in a browser: {CHROMIUM} (Debian's chromium) is not installed; "
              "`apt-get install chromium` to run this test (CI installs it and runs it)")


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile, nothing fetched, no sandbox (root in a container), no GPU."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}"]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not CHROMIUM.exists() and not REQUIRE_BROWSER, reason=NO_BROWSER)
def test_html_renders_in_headless_chromium_without_console_errors(tiny_runs, tmp_path):
    assert CHROMIUM.exists(), NO_BROWSER  # only reached without it when CI requires the browser
    page = (tiny_runs[0] / "report.html").resolve()
    shot = tmp_path / "page.png"
    out = chromium("--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=1200,4000",
                   page.as_uri(), profile=tmp_path / "profile-shot")
    assert shot.is_file() and shot.stat().st_size > 10_000, out.stderr[-2000:]
    console = [line for line in out.stderr.splitlines() if "CONSOLE" in line]  # the page has no script: none
    assert not console, console
    dom = chromium("--run-all-compositor-stages-before-draw", "--virtual-time-budget=5000", "--dump-dom",
                   page.as_uri(), profile=tmp_path / "profile-dom").stdout
    assert dom.count("data:image/png;base64,") == len(PLOTS)


def test_every_plot_labels_both_axes(tiny_runs, monkeypatch):
    from fisher_select.report import plots

    drawn = []
    real_uri = plots._uri
    monkeypatch.setattr(plots, "_uri", lambda fig: drawn.append(fig) or real_uri(fig))
    run = load_run(tiny_runs[0])
    assert {p.key for p in plots.all_plots(run.report)} == PLOTS
    for fig in drawn:
        for ax in fig.axes:
            if getattr(ax, "_colorbar", None) is None:  # a colorbar carries its own label
                assert ax.get_xlabel() and ax.get_ylabel(), (fig.axes[0].get_title(), ax.get_xlabel())


def test_verdict_comes_first_and_names_modules_certainty_and_advice(tiny_runs):
    from fisher_select.report.study_advice import finding_line

    run = load_run(tiny_runs[0])
    lines = summary_lines(run.report)
    assert lines[0].startswith("What to train:") and lines[1].startswith("How sure:")
    assert lines[2].startswith("What to change:")
    assert lines[3] == finding_line(run.report.objectives[0].type)  # the outcome study's verdicts for this kind
    top = sorted(run.report.modules, key=lambda m: (-m.bound_mass, m.name))[0]
    assert top.name in lines[0] and "S = " in lines[1] and "split halves" in lines[1]
    md = (tiny_runs[0] / "report.md").read_text()
    html = (tiny_runs[0] / "report.html").read_text()
    assert md.index("## Verdict") < md.index("## What these numbers do not promise")
    assert html.index("Verdict") < html.index("What these numbers do not promise")


# ---------------------------------------------------------------------------
# Rule coverage: each parameter's rule, every fallback named


class HalvedLinear(nn.Linear):
    """A subclass whose forward computes something else, with no rule of its own: the exact fallback's."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_report_lists_each_parameters_rule_and_names_every_fallback(tmp_path, tiny_runs):
    model = tiny_model("llama-tied")
    old = model.model.layers[0].mlp.up_proj
    model.model.layers[0].mlp.up_proj = HalvedLinear(old.in_features, old.out_features, bias=False)
    model.model.layers[0].mlp.up_proj.load_state_dict(old.state_dict())
    _, cal = _tiny_calibration(stability=False, model=model)
    run = write_run_with_pages(tmp_path / "run", cal, _report(cal), overwrite=False)
    data = json.loads((run / "report.json").read_text())
    fallback = "model.layers.0.mlp.up_proj.weight"
    rules = data["coverage"]["parameter_rules"]
    assert list(rules) == [n for n, _ in model.named_parameters()]
    assert [n for n, r in rules.items() if r == "fallback"] == data["coverage"]["fallback"] == [fallback]
    assert rules["model.layers.0.mlp.down_proj.weight"] == "LinearRule"  # its parent class's rule stays on Linear
    assert data["checks"]["selfcheck"]["parameters"] == len(rules) - 1  # the fallback is autograd already
    md, page = (run / "report.md").read_text(), (run / "report.html").read_text()
    assert f"| {fallback} | HalvedLinear |" in md and "1 on the exact per-sample fallback" in md
    assert f"<td>{fallback}</td><td>HalvedLinear</td>" in page and "Rule self-check" in page
    plain = (tiny_runs[0] / "report.md").read_text()
    assert "none on the fallback" in plain and "HalvedLinear" not in plain and "Rule self-check" in plain
