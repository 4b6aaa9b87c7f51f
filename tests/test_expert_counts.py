"""Tokens per expert of a calibration (``Calibration.expert_tokens`` / ``expert_positions``) on a tiny MoE.

The reference: each sampled sequence (prompt + response, no padding) run again through the model
alone, with forward hooks on its routers, whose top-k choices are counted at the response's
positions (tokens) and at every position (positions). The calibration counts them inside its
scoring passes (left padding, micro-batches, split halves, checkpoints, ranks); both must agree
exactly. One expert of each layer is made unreachable (router bias -1e3), so the report's
"unreached" flag is tested on an expert that really had no token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fisher_select.calibration.calibrator import calibrate
from fisher_select.calibration.checkpoint import CheckpointConfig
from fisher_select.calibration.objectives import RLObjective
from fisher_select.calibration.prompts import PromptRecord
from fisher_select.errors import FisherSelectError
from fisher_select.report import experts as rx
from tests.tiny import TinyTokenizer
from tests.tiny_moe import tiny_moe

PROMPTS = [PromptRecord(i, p, None, {}) for i, p in enumerate(["2 3", "4 2 9", "3 3", "7 4 4 5", "5"])]
EXPERTS, DEAD = 4, 3  # expert DEAD is never routed to (gpt-oss's router has a bias)


def reward(record, text):
    return float(len(text) % 2)


def moe(family: str = "gpt_oss"):
    model = tiny_moe(family, experts=EXPERTS, top_k=2)
    if family == "gpt_oss":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.router.bias"):
                    p[DEAD] = -1e3
    return model


def run(model, **kw):
    kw = {"stability": False, "batch_size": 6, "samples_per_prompt": 3, "max_new_tokens": 4, "seed": 5, **kw}
    return calibrate(model, TinyTokenizer(64), PROMPTS, RLObjective(reward), progress=False, **kw)


def routed(model, samples: list[dict]) -> tuple[dict, dict]:
    """(tokens, positions): experts module -> counts per expert, from the routers' own top-k choices."""
    tokens, positions, seen = {}, {}, {}
    hooks = [m.register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n.rpartition(".")[0] + ".experts",
                                                                              out[2].reshape(-1, out[2].shape[-1])))
             for n, m in model.named_modules() if n.endswith((".mlp.gate", ".mlp.router"))]
    try:
        for s in samples:
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])  # (1, T)
            with torch.no_grad():
                model(input_ids=ids)
            start = len(s["prompt_ids"])
            for name, index in seen.items():  # index: (T, k)
                for counts, rows in ((tokens, index[start:]), (positions, index)):
                    add = torch.bincount(rows.flatten(), minlength=EXPERTS).tolist()
                    counts[name] = [a + b for a, b in zip(counts.get(name, [0] * EXPERTS), add)]
    finally:
        for h in hooks:
            h.remove()
    return tokens, positions


def check_counts(cal, model) -> None:
    tokens, positions = routed(model, cal.samples)
    assert cal.expert_tokens == tokens and cal.expert_positions == positions
    response = sum(len(s["response_ids"]) for s in cal.samples)
    assert all(sum(c) == 2 * response for c in cal.expert_tokens.values())  # top-2: each token counts twice


@pytest.mark.parametrize("kw", [{}, {"stability": True, "max_batch_tokens": 12}], ids=["whole", "halves"])
def test_counts_are_the_routers_choices_on_the_sampled_responses(kw):
    model = moe()
    cal = run(model, **kw)
    check_counts(cal, model)
    assert set(cal.expert_tokens) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert all(c[DEAD] == 0 for c in cal.expert_positions.values())
    assert all(c[e] > 0 for c in cal.expert_tokens.values() for e in range(EXPERTS) if e != DEAD)
    if kw.get("stability"):
        assert cal.diagnostics.split_half is not None  # both halves scored, both counted


def test_resumed_counts_equal_the_uninterrupted_ones(tmp_path):
    from tests.test_fsdp_calibrate import Stop, _stop_after

    kw = {"stability": True, "batch_size": 3}
    want = run(moe(), **kw)
    undo = _stop_after(2)
    try:
        with pytest.raises(Stop):
            run(moe(), **kw, checkpoint=CheckpointConfig(tmp_path / "c", every=1, model_id="moe"))
    finally:
        undo()
    got = run(moe(), **kw, checkpoint=CheckpointConfig(tmp_path / "c", every=1, resume=True, model_id="moe"))
    assert got.expert_tokens == want.expert_tokens and got.expert_positions == want.expert_positions
    assert got.samples == want.samples


def test_report_shows_tokens_per_expert_and_flags_the_unreached_one(tmp_path):
    from fisher_select.models import fingerprint
    from fisher_select.report.build import build_report, regenerate, write_run_with_pages
    from fisher_select.run.schema import ModelInfo

    model = moe()
    cal = run(model)
    report = build_report(cal, model=ModelInfo("tiny-moe", fingerprint(model), None, None, None, None), recipe=None,
                          recipe_name=None, sampling={"temperature": 1.0}, settings={})
    out = write_run_with_pages(tmp_path / "run", cal, report, overwrite=False)
    stored = json.loads((out / "report.json").read_text())["experts"]
    layers = stored["layers"]
    assert [layer["module"] for layer in layers] == sorted(cal.expert_tokens)
    for layer in layers:
        assert layer["tokens"] == cal.expert_tokens[layer["module"]]
        assert layer["positions"] == cal.expert_positions[layer["module"]]
        assert layer["positions"][DEAD] == 0 and layer["flags"][DEAD] == rx.UNREACHED  # really no token at all
        assert [e for e, f in enumerate(layer["flags"]) if f == rx.UNREACHED] == [DEAD]
        fisher = sum(float(cal.fisher[f"{layer['module']}.{leaf}"][DEAD].sum())
                     for leaf in ("gate_up_proj", "down_proj"))
        assert layer["bound_mass"][DEAD] == 0.0 and fisher == 0.0
    for page in ("report.md", "report.html"):
        assert rx.UNREACHED_TEXT in (out / page).read_text()
    for recompute in (False, True):  # `fisher-select report RUN [--recompute]`: counts kept (masses from F)
        (out / "report.md").unlink()
        regenerate(out, recompute=recompute)
        assert json.loads((out / "report.json").read_text())["experts"] == stored
        assert rx.UNREACHED_TEXT in (out / "report.md").read_text()


# ---------------------------------------------------------------------------
# Two gloo ranks: data parallel (gpt-oss) and FSDP (Mixtral, split halves, micro-batches, resumed)

HALVES = {"stability": True, "max_batch_tokens": 12}


def _job(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from fisher_select.calibration import fsdp
    from tests.test_fsdp_calibrate import Stop, _stop_after, _summary

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = {"dp": run(moe()), "mixtral/dp": run(moe("mixtral"), **HALVES),
                "mixtral/fsdp": run(fsdp.wrap(moe("mixtral")), shard="fsdp", **HALVES)}
        folder = Path(f"{out}.checkpoint")
        undo = _stop_after(1)  # interrupted after its first batch, then resumed from the checkpoint
        try:
            run(fsdp.wrap(moe("mixtral")), shard="fsdp", **HALVES, checkpoint=CheckpointConfig(folder, every=1,
                                                                                              model_id="moe"))
            raise AssertionError("not interrupted")
        except Stop:
            pass
        finally:
            undo()
        dist.barrier()  # rank 0 writes the checkpoint: no rank looks for it before it is there
        runs["mixtral/resumed"] = run(fsdp.wrap(moe("mixtral")), shard="fsdp", **HALVES,
                                      checkpoint=CheckpointConfig(folder, every=1, resume=True, model_id="moe"))
        keep = {k: None if c is None else {**_summary(c), "tokens": c.expert_tokens, "positions": c.expert_positions}
                for k, c in runs.items()}
        torch.save(keep, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow  # two spawned ranks, five calibrations each: 20-35 s on the shared 2-core machine
@pytest.mark.filterwarnings("ignore::fisher_select.errors.DegenerateResultWarning")  # a one-prompt share: S = 0
def test_two_ranks_count_like_one_process(tmp_path):
    import torch.multiprocessing as mp

    from fisher_select.distributed import seed_for_rank, shard
    from tests.test_fsdp_calibrate import _assert_same
    from tests.tiny import free_port

    out = str(tmp_path / "rank")
    mp.start_processes(_job, args=(2, free_port(), out), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    dp = ranks[0]["dp"]
    tokens, positions = routed(moe(), dp["samples"])  # brute force over every rank's samples
    assert dp["tokens"] == tokens and dp["positions"] == positions and ranks[1]["dp"]["tokens"] == tokens
    parts = [calibrate(moe(), TinyTokenizer(64), shard(PROMPTS, r, 2), RLObjective(reward), stability=False,
                       batch_size=6, samples_per_prompt=3, max_new_tokens=4, seed=seed_for_rank(5, r), progress=False)
             for r in range(2)]  # each rank's share in one process, summed by hand
    assert dp["tokens"] == {m: [a + b for a, b in zip(*(p.expert_tokens[m] for p in parts))] for m in tokens}
    got, want = ranks[0]["mixtral/fsdp"], ranks[0]["mixtral/dp"]
    assert ranks[1]["mixtral/fsdp"] is None  # rank 0 alone holds the result
    _assert_same(got, want, units=False)  # F, g, S and the samples
    assert got["tokens"] == want["tokens"] and got["positions"] == want["positions"]
    assert (got["tokens"], got["positions"]) == routed(moe("mixtral"), got["samples"])
    resumed = ranks[0]["mixtral/resumed"]  # FSDP checkpoint: every rank's counts, cut and gathered again
    _assert_same(resumed, got)
    assert resumed["tokens"] == got["tokens"] and resumed["positions"] == got["positions"]


def test_counts_of_a_module_the_section_does_not_split_are_left_out_not_refused():
    from fisher_select.report.build import _experts_json

    fisher = {"model.layers.0.mlp.experts.gate_up_proj": torch.ones(EXPERTS, 8, 16),
              "model.layers.0.mlp.experts.down_proj": torch.ones(EXPERTS, 8, 8)}
    counts = {"model.layers.0.mlp.experts": [1, 2, 3, 4], "model.layers.0.mlp.moe_linear": [5, 6]}  # the last: no
    section = _experts_json(fisher, 1.0, counts, None)  # fused tensors the section recognises
    assert [layer["tokens"] for layer in section["layers"]] == [[1, 2, 3, 4]]
    assert _experts_json(fisher, 1.0, {"model.layers.0.mlp.moe_linear": [5, 6]}, None)["layers"][0]["tokens"] is None
    assert _experts_json({"lm_head.weight": torch.ones(2, 2)}, 1.0, {}, {}) is None  # a dense model: no section


def test_a_prompt_only_expert_is_reached_and_no_position_means_unreached():
    """A prompt token routed to an expert reaches the responses through attention: F > 0 with 0 response tokens
    is no bug once the positions are known; an expert no position reached is unreached."""
    fisher = {"model.layers.0.mlp.experts.gate_up_proj": torch.ones(EXPERTS, 8, 16),
              "model.layers.0.mlp.experts.down_proj": torch.ones(EXPERTS, 8, 8)}
    fisher = {n: f * torch.tensor([1.0, 1.0, 1.0, 0.0]).reshape(-1, 1, 1) for n, f in fisher.items()}  # expert 3: F = 0
    tokens = {"model.layers.0.mlp": [4, 0, 2, 0]}  # expert 1: prompt positions only
    without = rx.expert_section(fisher, 1.0, tokens).layers[0]
    assert without.flags == ["", rx.NO_TOKENS_BUT_F, "", rx.UNREACHED]
    layer = rx.expert_section(fisher, 1.0, tokens, {"model.layers.0.mlp": [6, 3, 2, 0]}).layers[0]
    assert layer.flags == ["", "", "", rx.UNREACHED] and layer.positions == [6, 3, 2, 0]
    with pytest.raises(FisherSelectError, match="position counts of .* list 2 experts"):
        rx.expert_section(fisher, 1.0, tokens, {"model.layers.0.mlp": [1, 1]})
