"""Coordinate masks: every rule checked against a brute-force reference on a small synthetic run."""

from __future__ import annotations

import json
import math
import re

import pytest

import torch

from fisher_select.errors import FisherSelectError
from fisher_select.caveats import MASK_CAVEAT as CAVEAT
from fisher_select.outputs.masks import load_masks, save_masks, select_masks
from fisher_select.run.io import save_tensors
from fisher_select.run.load import Run
from fisher_select.run.names import sidecar_path
from fisher_select.stats.ranking import top_count, top_k_mask

SHAPES = {  # deliberately not in sorted order; mixes 2-D weights with 1-D parameters
    "mlp.up.weight": (6, 5),
    "attn.q.weight": (4, 7),
    "attn.q.bias": (4,),
    "norm.weight": (5,),
    "mlp.down.weight": (5, 6),
}
SCALE = 2.0
from tests import runs
from tests.runs import write_run_dir
from tests.tiny import run_command


def make_run(fisher: dict[str, torch.Tensor], scale: float | None = SCALE) -> Run:
    return runs.make_run(fisher, objectives=[{"name": "rl", "signal_scale": scale}, {"name": "sft", "signal_scale": 8.0}],
                         caveats=["the bound covers one step"])


def tied_fisher(seed: int = 0) -> dict[str, torch.Tensor]:
    """Multiples of 1/4 (exact fp64 sums) from 0 to 2: many ties and zeros."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randint(0, 9, s, generator=gen).float() / 4 for n, s in SHAPES.items()}


def continuous_fisher(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.rand(s, generator=gen) ** 3 for n, s in SHAPES.items()}


# ---------------------------------------------------------------------------
# Brute-force references: concatenate in canonical order (sorted names, flat index), stable sort.


def concat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1) for n in sorted(tensors)])


def split(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name in sorted(like):
        n = like[name].numel()
        out[name] = flat[start : start + n].reshape(like[name].shape)
        start += n
    return out


def first_k_by_value(values: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(values, descending=True, stable=True).indices
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def smallest_mass_set(values: torch.Tensor, q: float) -> torch.Tensor:
    order = torch.sort(values, descending=True, stable=True).indices
    running = values.double()[order].cumsum(0)
    k = int((running < q * float(values.double().sum())).sum()) + 1
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def assert_masks_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == torch.bool and got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name


# ---------------------------------------------------------------------------
# Rules


@pytest.mark.parametrize("fraction", [1e-9, 0.1, 0.37, 0.5, 1.0])
@pytest.mark.parametrize("make", [tied_fisher, continuous_fisher])
def test_top_fraction_equals_brute_force_ranking(fraction, make):
    run = make_run(make())
    got = select_masks(run, top=fraction)
    f = concat(run.fisher)
    k = max(1, math.floor(fraction * f.numel() + 0.5))
    assert got.selected == k == top_count(fraction, f.numel())
    assert_masks_equal(got.masks, split(first_k_by_value(f, k), run.fisher))
    # Ranked by F, these are the top coordinates by bound too: none left out has a larger bound.
    chosen, bounds = concat(got.masks), concat(run.bound())
    if k < f.numel():
        assert bounds[chosen].min() >= bounds[~chosen].max()


def test_top_is_defined_when_the_signal_scale_is_zero():
    # S = 0 makes every bound 0; the ranking by F (the bound's order for any S > 0) remains.
    run = make_run(continuous_fisher(), scale=0.0)
    got = select_masks(run, top=0.2)
    f = concat(run.fisher)
    assert torch.equal(concat(got.masks), first_k_by_value(f, top_count(0.2, f.numel())))


def test_top_ties_go_to_canonical_order():
    # All equal: the first k coordinates in (sorted name, flat index) order win.
    run = make_run({n: torch.ones(s) for n, s in SHAPES.items()})
    got = concat(select_masks(run, top=0.25).masks)
    k = top_count(0.25, got.numel())
    assert got[:k].all() and not got[k:].any()


@pytest.mark.parametrize("q", [0.05, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("make", [tied_fisher, continuous_fisher])
def test_mass_rule_is_smallest_set(q, make):
    run = make_run(make())
    got = select_masks(run, fisher_mass=q)
    f = concat(run.fisher)
    want = smallest_mass_set(f, q)
    assert_masks_equal(got.masks, split(want, run.fisher))
    # Smallest: it reaches q of the mass, and one coordinate fewer would not.
    chosen = f[concat(got.masks)].double()
    assert chosen.sum() >= q * f.double().sum()
    assert chosen.sum() - chosen.min() < q * f.double().sum()


@pytest.mark.parametrize("q", [0.05, 0.5, 0.9])
def test_bound_mass_rule_is_the_smallest_set_of_the_sum_of_sqrt_f(q):
    run = make_run(continuous_fisher())
    got = select_masks(run, bound_mass=q)
    root = concat(run.fisher).sqrt()
    assert_masks_equal(got.masks, split(smallest_mass_set(root, q), run.fisher))
    # Q of the bound mass takes at least as many coordinates as Q of the Fisher mass: F is concentrated.
    assert got.selected >= select_masks(run, fisher_mass=q).selected
    assert got.meta["rule"]["name"] == "bound_mass"


def test_the_old_mass_flag_is_gone(tmp_path, capsys):
    run_dir = write_run_dir(make_run(continuous_fisher()), tmp_path / "run")
    with pytest.raises(SystemExit):  # argparse: an unknown argument, no hidden flag kept to refuse it
        run_command(["select", str(run_dir), "--top", "0.5", "--mass", "0.5", "--out", str(tmp_path / "m.safetensors")])
    assert "unrecognized arguments: --mass 0.5" in capsys.readouterr().err


def test_mass_one_skips_zero_fisher():
    run = make_run(tied_fisher())
    got = concat(select_masks(run, fisher_mass=1.0).masks)
    assert torch.equal(got, concat(run.fisher) > 0)


@pytest.mark.parametrize("objective", [None, "sft"])
def test_threshold_equals_bound_above_tau(objective):
    run = make_run(tied_fisher())
    bounds = run.bound(objective)
    tau = float(concat(bounds).median())  # a tie value: equal bounds are not selected
    got = select_masks(run, threshold=tau, objective=objective)
    assert_masks_equal(got.masks, {n: b > tau for n, b in bounds.items()})
    assert 0 < got.selected < concat(bounds).numel()


@pytest.mark.parametrize("rule", [{"top": 0.3}, {"fisher_mass": 0.6}])
def test_per_module_applies_budget_within_each_parameter(rule):
    run = make_run(tied_fisher(1))
    got = select_masks(run, per_module=True, **rule)
    want = {}
    for name, f in run.fisher.items():
        if "top" in rule:
            flat = first_k_by_value(f.reshape(-1), top_count(rule["top"], f.numel()))
        else:
            flat = smallest_mass_set(f.reshape(-1), rule["fisher_mass"])
        want[name] = flat.reshape(f.shape)
    assert_masks_equal(got.masks, want)


def unit_reference(run: Run, structured: str) -> tuple[list, dict]:
    """Units (value F_u, name, index) in canonical order, plus an expander back to masks."""
    units = []
    for name in sorted(run.fisher):
        f = run.fisher[name].double()
        sums = (f.sum(1) if structured == "rows" else f.sum(0)) if f.dim() == 2 else f.reshape(-1)
        units += [(float(v), name, i) for i, v in enumerate(sums)]

    def expand(chosen):
        masks = {n: torch.zeros(f.shape, dtype=torch.bool) for n, f in run.fisher.items()}
        for _, name, i in chosen:
            m = masks[name]
            if m.dim() != 2:
                m.view(-1)[i] = True
            elif structured == "rows":
                m[i, :] = True
            else:
                m[:, i] = True
        return masks

    return units, expand


@pytest.mark.parametrize("structured", ["rows", "columns"])
def test_structured_top_mass_threshold(structured):
    run = make_run(tied_fisher(2))
    units, expand = unit_reference(run, structured)
    ranked = sorted(units, key=lambda u: -u[0])  # stable: canonical order among ties

    k = top_count(0.3, len(units))
    got = select_masks(run, top=0.3, structured=structured)
    assert_masks_equal(got.masks, expand(ranked[:k]))

    total, running, chosen = sum(u[0] for u in units), 0.0, []
    for u in ranked:
        if running >= 0.7 * total:
            break
        chosen.append(u)
        running += u[0]
    assert_masks_equal(select_masks(run, fisher_mass=0.7, structured=structured).masks, expand(chosen))

    # Unit bound sqrt(S * F_u) bounds the norm of the row's (column's) expected gradient.
    tau = 3.0
    above = [u for u in units if math.sqrt(SCALE * u[0]) > tau]
    got = select_masks(run, threshold=tau, structured=structured)
    assert_masks_equal(got.masks, expand(above))
    assert 0 < len(above) < len(units)


def test_structured_rows_select_whole_rows():
    run = make_run(continuous_fisher())
    masks = select_masks(run, top=0.4, structured="rows").masks
    for name, m in masks.items():
        if m.dim() == 2:
            assert torch.equal(m, m[:, :1].expand_as(m)), name


def test_top_k_mask_matches_sort_on_large_tensor():
    gen = torch.Generator().manual_seed(3)
    values = (torch.randint(0, 1000, (300_000,), generator=gen).float() * torch.rand(300_000, generator=gen))
    got = top_k_mask(values, 12_345)
    assert torch.equal(got, first_k_by_value(values, 12_345))


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"top": 0.0}, "outside (0, 1]"),
        ({"top": 1.5}, "outside (0, 1]"),
        ({"fisher_mass": -0.1}, "outside (0, 1]"), ({"bound_mass": 1.1}, "outside (0, 1]"),
        ({}, "exactly one"),
        ({"top": 0.1, "fisher_mass": 0.5}, "exactly one"), ({"fisher_mass": 0.1, "bound_mass": 0.5}, "exactly one"),
        ({"top": 0.1, "structured": "diagonal"}, "unknown structure"),
        ({"threshold": 1.0, "per_module": True}, "per-module"),
        ({"top": 0.1, "objective": "dpo"}, "no objective 'dpo'"),
    ],
)
def test_bad_arguments(kwargs, words):
    with pytest.raises(FisherSelectError, match=words.replace("(", r"\(").replace("]", r"\]")):
        select_masks(make_run(tied_fisher()), **kwargs)


def test_threshold_needs_signal_scale():
    run = make_run(tied_fisher(), scale=None)
    with pytest.raises(FisherSelectError, match="signal scale"):
        select_masks(run, threshold=0.5)
    assert select_masks(run, top=0.2).selected > 0  # ranking alone still works


def test_non_finite_fisher_is_an_error():
    fisher = tied_fisher()
    fisher["norm.weight"][2] = float("nan")
    with pytest.raises(FisherSelectError, match="norm.weight"):
        select_masks(make_run(fisher), top=0.1)


# ---------------------------------------------------------------------------
# Files and CLI


def test_save_load_round_trip(tmp_path):
    run = make_run(tied_fisher())
    maskset = select_masks(run, top=0.2, structured="rows")
    path = save_masks(maskset, tmp_path / "m.safetensors")
    masks, meta = load_masks(path)
    assert_masks_equal(masks, maskset.masks)
    side = json.loads(sidecar_path(path).read_text())
    assert side == meta
    assert meta["run_id"] == "run-test" and meta["model"]["fingerprint"] == {"id": "synthetic"}
    assert meta["rule"] == {"name": "top", "value": 0.2, "per_module": False, "structured": "rows",
                            "objective": "rl", "signal_scale": SCALE, "score": "bound"}
    assert meta["caveat"] == CAVEAT and meta["run_caveats"] == ["the bound covers one step"]
    assert meta["selected"] == sum(int(m.sum()) for m in masks.values())
    by_module = {m["name"]: m for m in meta["modules"]}
    q = by_module["attn.q"]
    assert q["selected"] == int(masks["attn.q.weight"].sum() + masks["attn.q.bias"].sum())
    assert q["density"] == pytest.approx(q["selected"] / 32)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_save_refuses_to_overwrite_and_load_detects_foreign_sidecar(tmp_path):
    run = make_run(tied_fisher())
    path = save_masks(select_masks(run, top=0.2), tmp_path / "m.safetensors")
    with pytest.raises(FisherSelectError, match="already exists"):
        save_masks(select_masks(run, top=0.3), path)
    other = save_masks(select_masks(run, top=0.3), tmp_path / "other.safetensors")
    sidecar_path(path).write_text(sidecar_path(other).read_text())
    with pytest.raises(FisherSelectError, match="describes another mask file"):
        load_masks(path)


def test_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(FisherSelectError, match="does not exist"):
        load_masks(tmp_path / "nope.safetensors")
    save_tensors(tmp_path / "plain.safetensors", {"x": torch.zeros(2)})
    with pytest.raises(FisherSelectError, match="not a fisher_select mask file"):
        load_masks(tmp_path / "plain.safetensors")






def test_cli_select_writes_masks_and_prints_counts(tmp_path, capsys):
    run = make_run(tied_fisher())
    run_dir = write_run_dir(run, tmp_path / "run")
    out = tmp_path / "masks.safetensors"
    assert run_command(["select", str(run_dir), "--fisher-mass", "0.5", "--per-module", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    masks, meta = load_masks(out)
    assert_masks_equal(masks, select_masks(run, fisher_mass=0.5, per_module=True).masks)
    for m in meta["modules"]:
        assert m["name"] in text and f"{m['selected']:,}" in text
    assert CAVEAT in text and CAVEAT.startswith("Caveat:")
    with pytest.raises(FisherSelectError, match="already exists"):
        run_command(["select", str(run_dir), "--top", "0.1", "--out", str(out)])
    with pytest.raises(FisherSelectError, match="outside"):
        run_command(["select", str(run_dir), "--top", "2", "--out", str(tmp_path / "x.safetensors")])
    with pytest.raises(SystemExit):  # argparse: the rules are mutually exclusive
        run_command(["select", str(run_dir), "--top", "0.1", "--fisher-mass", "0.5", "--out", str(out)])


def test_cli_select_summary_lists_the_most_selected_modules_unless_all(tmp_path, capsys, monkeypatch):
    import fisher_select.commands.select as select_command

    monkeypatch.setattr(select_command, "SUMMARY_MODULES", 1)
    run_dir = write_run_dir(make_run(tied_fisher()), tmp_path / "run")
    assert run_command(["select", str(run_dir), "--top", "0.5", "--out", str(tmp_path / "a.safetensors")]) == 0
    short = capsys.readouterr().out
    _, meta = load_masks(tmp_path / "a.safetensors")
    ranked = sorted(meta["modules"], key=lambda m: (-m["selected"], m["name"]))
    assert len(ranked) > 1 and ranked[0]["name"] in short
    assert all(f"{m['name']} " not in short for m in ranked[1:])
    assert f"{len(ranked) - 1} more modules (--all lists every one)" in short
    assert run_command(["select", str(run_dir), "--top", "0.5", "--all", "--out", str(tmp_path / "b.safetensors")]) == 0
    full = capsys.readouterr().out
    assert all(m["name"] in full for m in ranked) and "more modules" not in full


def test_zero_signal_scale_refuses_threshold_and_warns_on_rankings():
    run = make_run(continuous_fisher(), scale=0.0)
    with pytest.raises(FisherSelectError, match="S = 0.*--threshold would select nothing"):
        select_masks(run, threshold=1e-4)
    got = select_masks(run, top=0.2)
    assert len(got.meta["warnings"]) == 1 and "ranks by F alone" in got.meta["warnings"][0]
    assert select_masks(make_run(continuous_fisher()), top=0.2).meta["warnings"] == []


def test_a_selection_above_half_the_model_warns_with_the_thresholds_of_1_and_10_percent(tmp_path):
    run = make_run(continuous_fisher())
    got = select_masks(run, threshold=1e-9)  # tiny: nearly every coordinate
    assert got.meta["density"] > 0.5
    (warning,) = [w for w in got.meta["warnings"] if "more than half" in w]
    assert f"{got.meta['density']:.1%} of the model" in warning
    values = [float(v) for v in re.findall(r"--threshold (\S+) for about", warning)]
    assert len(values) == 2 and "about 1%" in warning and "about 10%" in warning
    for value, share in zip(values, (0.01, 0.10)):  # each suggestion selects about that share
        assert select_masks(run, threshold=value).meta["density"] == pytest.approx(share, abs=0.005)
    assert not select_masks(run, threshold=values[1]).meta["warnings"]
    top = select_masks(run, top=0.6).meta["warnings"]
    assert any("more than half" in w and "--top 0.01" in w for w in top)


def test_the_cli_prints_the_oversized_selection_warning(tmp_path, capsys):
    run_dir = write_run_dir(make_run(continuous_fisher()), tmp_path / "run")
    assert run_command(["select", str(run_dir), "--threshold", "1e-9", "--out", str(tmp_path / "m.safetensors")]) == 0
    assert "warning: the selection holds" in capsys.readouterr().out


def test_top_by_the_gradient_estimate_equals_brute_force_ranking_of_abs_g_hat(tmp_path):
    """--score grad_estimate: the top coordinates by |g_hat| of the objective (read from the run
    directory), exactly k, ties in canonical order; the CLI writes the same masks."""
    run = make_run(continuous_fisher())
    run_dir = write_run_dir(run, tmp_path / "run")
    g = torch.Generator().manual_seed(3)
    grad = {n: torch.randn(f.shape, generator=g) for n, f in run.fisher.items()}
    save_tensors(run_dir / "grad_estimate.safetensors", grad)
    got = select_masks(run_dir, top=0.2, score="grad_estimate")
    a = concat(grad).abs()
    k = top_count(0.2, a.numel())
    assert got.selected == k and got.meta["rule"]["score"] == "grad_estimate"
    assert_masks_equal(got.masks, split(first_k_by_value(a, k), grad))
    assert not torch.equal(concat(got.masks), concat(select_masks(run_dir, top=0.2).masks))  # not F's order
    out = tmp_path / "g.safetensors"
    assert run_command(["select", str(run_dir), "--top", "0.2", "--score", "grad_estimate", "--out", str(out)]) == 0
    assert_masks_equal(load_masks(out)[0], got.masks)


def test_the_gradient_estimate_score_refuses_what_it_cannot_do(tmp_path):
    run_dir = write_run_dir(make_run(tied_fisher()), tmp_path / "run")
    with pytest.raises(FisherSelectError, match="keeps no gradient estimate for objective 'rl'"):
        select_masks(run_dir, top=0.1, score="grad_estimate")
    with pytest.raises(FisherSelectError, match="--top only; drop --fisher-mass"):
        select_masks(run_dir, fisher_mass=0.5, score="grad_estimate")
    with pytest.raises(FisherSelectError, match="unknown score 'abs'"):
        select_masks(run_dir, top=0.1, score="abs")
