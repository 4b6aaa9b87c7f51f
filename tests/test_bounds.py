"""stats.bounds: per-module masses against a per-coordinate loop, and the bound."""

from __future__ import annotations

import math

import torch

from fisher_select.stats.bounds import coordinate_bound, module_masses


def _fisher():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.rand(7, 5, generator=g) ** 3, "a.bias": torch.rand(7, generator=g),
            "b.weight": torch.rand(4, 3, generator=g) * 1e-3, "c.weight": torch.zeros(2, 2),
            "a.extra": torch.tensor([1e8, 1e-8, -1e-12])}  # a huge coordinate; a rounding-negative one counts as 0


def test_module_masses_match_a_per_coordinate_loop_in_float64():
    fisher = _fisher()
    masses = module_masses(fisher)
    assert list(masses) == ["a", "b", "c"]  # order of first appearance
    for mod, m in masses.items():
        coords = [float(x) for name, t in fisher.items() if name.split(".")[0] == mod for x in t.flatten().tolist()]
        assert m.numel == len(coords)
        # fp64 sums: within a few fp64 roundings of the exact sum
        assert abs(m.fisher_mass - math.fsum(coords)) <= 1e-14 * max(1.0, m.fisher_mass)
        assert abs(m.bound_mass - math.fsum(math.sqrt(max(x, 0.0)) for x in coords)) <= 1e-14 * max(1.0, m.bound_mass)
        assert m.root_max == max(math.sqrt(max(x, 0.0)) for x in coords)
    assert masses["a"].parameters == ["a.weight", "a.bias", "a.extra"]


def test_module_masses_do_not_depend_on_the_parameters_order():
    fisher = _fisher()
    backwards = dict(reversed(list(fisher.items())))
    one, other = module_masses(fisher), module_masses(backwards)
    for mod in one:
        assert (one[mod].fisher_mass, one[mod].bound_mass) == (other[mod].fisher_mass, other[mod].bound_mass)


def test_coordinate_bound_is_sqrt_f_s_and_zero_where_f_is_zero_even_for_infinite_s():
    f = {"w": torch.tensor([0.0, 4.0, 9.0])}
    assert torch.equal(coordinate_bound(f, 4.0)["w"], torch.tensor([0.0, 4.0, 6.0]))
    assert torch.equal(coordinate_bound(f, None)["w"], torch.tensor([0.0, 2.0, 3.0]))
    assert coordinate_bound(f, math.inf)["w"].tolist() == [0.0, math.inf, math.inf]


def test_module_masses_leave_an_fp64_fisher_as_it_was():
    f = {"m.weight": torch.tensor([-1e-12, 4.0], dtype=torch.float64)}
    masses = module_masses(f)
    assert f["m.weight"].tolist() == [-1e-12, 4.0]  # the in-place square root works on a copy
    assert masses["m"].bound_mass == 2.0 and masses["m"].fisher_mass == 4.0 - 1e-12
