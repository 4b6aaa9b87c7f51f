"""FSDP2-sharded scoring (engine/sharded.py): two gloo ranks on the CPU against one process.

Each rank scores its own rows of the same 4-row batch on a model wrapped with ``fully_shard``
(each decoder layer, then the root); its accumulators must equal the matching rows of the
one-process sums over all 4 rows, cut as FSDP2 cuts the parameters (uneven dims included), and
the gathered sums must equal the one-process sums. Tiny MoE models (Mixtral, Qwen3-MoE) run the
same checks, with their tokens per expert summed over ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from fisher_select.engine.scoring import score_sums
from tests.tiny import free_port, random_batch, tiny_model
from tests.tiny_moe import tiny_moe

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


def odd_llama(seed=0):
    """A tied tiny Llama whose dim 0 sizes do not divide by 2: vocab 63, hidden 15, MLP 33."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=63, hidden_size=15, intermediate_size=33, num_hidden_layers=2,
                                         num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                                         tie_word_embeddings=True, eos_token_id=1, bos_token_id=None, pad_token_id=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


MODELS = {"odd-tied": odd_llama, "llama-untied": lambda: tiny_model("llama-untied"),
          # MoE (4 experts, top-2): the 3-D expert tensors and the routers are cut along the experts dim
          "mixtral": lambda: tiny_moe("mixtral", dtype=torch.float32),
          "qwen3-moe": lambda: tiny_moe("qwen3_moe", dtype=torch.float32)}
# Rank 0 scores rows 0-2 in two batches, rank 1 row 3 in one: rank 1 must run a padding batch.
SPLIT = {0: [slice(0, 2), slice(2, 3)], 1: [slice(3, 4)]}


def _data():
    ids, attn, resp, signal = random_batch(batch=4, vocab=63)
    return ids, attn, resp, torch.stack([signal, signal.flip(0)])  # (2, 4): two objectives


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from fisher_select.engine.sharded import score_sums_sharded

        mesh = init_device_mesh("cpu", (world,))
        ids, attn, resp, signal = _data()
        result = {}
        for key, make in MODELS.items():
            model = make()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            batches = [(ids[r], attn[r], resp[r], signal[:, r]) for r in SPLIT[rank]]
            sharded = score_sums_sharded(model, batches, objectives=2)
            gathered = sharded.gather()
            fisher_only = score_sums_sharded(model, [b[:3] for b in batches], totals=False)
            result[key] = {"squares": sharded.squares, "signal": sharded.signal, "total": sharded.total,
                           "count": sharded.count, "layouts": sharded.layouts, "peak": sharded.peak_bytes,
                           "full": sharded.full_bytes, "kept": sharded.nbytes(),
                           "gathered": None if gathered is None else vars(gathered),
                           "fisher_only": fisher_only.squares, "fisher_only_peak": fisher_only.peak_bytes,
                           "fisher_only_full": fisher_only.full_bytes,
                           "grads": [n for n, p in model.named_parameters() if p.grad is not None],
                           "expert_tokens": sharded.expert_tokens, "expert_positions": sharded.expert_positions}
        torch.save(result, f"{out}.{rank}")
        # A gloo rank exiting while its peer still works sometimes aborts at exit ("terminate called
        # without an active exception", SIGABRT; about 1 run in 8 here): leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # the results are on disk; skip the interpreter teardown where that abort happens


def _close(got, want, what):
    """Equal up to fp32 accumulation in another order (the ranks score other batch shapes): an entry of a
    signed total near 0 (cancellation) may differ by some fp32 ulps of the tensor's largest entry (on an AMD
    EPYC, 9 ulps); a row lost, doubled or given to the wrong rank moves entries by a whole score, far above."""
    scale = float(want.abs().max()) or 1.0
    atol = 32 * torch.finfo(torch.float32).eps * scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _rows(t, lay, lead):
    return t if lay.dim is None else t.narrow(lay.dim + lead, lay.start, lay.stop - lay.start)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "rank"
    mp.start_processes(_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("key", list(MODELS))
def test_each_rank_keeps_its_rows_of_the_one_process_sums(ranks, key):
    ids, attn, resp, signal = _data()
    want = score_sums(MODELS[key](), ids, attn, resp, signal)
    seen = {}
    for rank, got in enumerate(r[key] for r in ranks):
        assert got["count"] == 4
        assert got["grads"] == []  # no parameter .grad was built, sharded or not
        assert set(got["squares"]) == set(want.squares)
        for name, lay in got["layouts"].items():
            assert lay.dim == 0 and lay.shape == tuple(want.squares[name].shape)
            seen.setdefault(name, []).append((lay.start, lay.stop))
            _close(got["squares"][name], _rows(want.squares[name], lay, 0), f"rank {rank} squares {name}")
            _close(got["total"][name], _rows(want.total[name], lay, 0), f"rank {rank} total {name}")
            _close(got["signal"][name], _rows(want.signal[name], lay, 1), f"rank {rank} signal {name}")
            _close(got["fisher_only"][name], _rows(want.squares[name], lay, 0), f"rank {rank} fisher-only {name}")
    for name, parts in seen.items():  # the two ranks' rows tile dim 0, FSDP2's torch.chunk cut
        rows = want.squares[name].shape[0]
        chunk = -(-rows // 2)
        assert parts == [(0, chunk), (chunk, rows)], name
    if key == "odd-tied":
        assert any(want.squares[n].shape[0] % 2 for n in seen)  # uneven cuts were exercised
        assert "lm_head.weight" not in want.squares  # tied: one accumulator for embedding and head


@pytest.mark.parametrize("key", list(MODELS))
def test_gather_on_rank_0_equals_the_one_process_sums(ranks, key):
    ids, attn, resp, signal = _data()
    want = score_sums(MODELS[key](), ids, attn, resp, signal)
    got = ranks[0][key]["gathered"]
    assert ranks[1][key]["gathered"] is None and got["count"] == 4
    for kind in ("squares", "total", "signal"):
        assert set(got[kind]) == set(getattr(want, kind))
        for name, t in got[kind].items():
            assert t.shape == getattr(want, kind)[name].shape
            _close(t, getattr(want, kind)[name], f"gathered {kind} {name}")


@pytest.mark.parametrize("key", ["mixtral", "qwen3-moe"])
def test_tokens_per_expert_are_summed_over_ranks_without_the_padding_batch(ranks, key):
    ids, attn, resp, signal = _data()
    want = score_sums(MODELS[key](), ids, attn, resp, signal)
    assert want.expert_tokens and want.expert_positions
    for got in (r[key] for r in ranks):
        for kind in ("expert_tokens", "expert_positions"):
            assert set(got[kind]) == set(getattr(want, kind))
            for module, counts in getattr(want, kind).items():
                assert torch.equal(got[kind][module], counts), (kind, module)
        if got["gathered"] is not None:
            assert all(torch.equal(got["gathered"]["expert_tokens"][m], c) for m, c in got["expert_tokens"].items())


def test_sharded_accumulators_take_about_half_the_memory(ranks):
    for got in (r["llama-untied"] for r in ranks):
        # kept: this rank's shards, about 1/2 of the full accumulators; peak adds a layer's buffer
        assert got["kept"] <= got["full"] / 2 + 4 * 1024
        assert got["kept"] < got["peak"] < got["full"]
        assert got["fisher_only_peak"] < got["fisher_only_full"]


@pytest.mark.parametrize("key", ["llama-tied", "llama-fallback", "linear-called-twice"])
def test_done_reports_each_parameter_once_when_its_sums_are_final(key):
    """score_sums(done=): what a parameter's sums hold when reported is what they end with."""
    from fisher_select.engine.scoring import ScoreSums, plan_coverage

    model = tiny_model(key)
    ids, attn, resp, signal = random_batch(batch=3)
    cov = plan_coverage(model)
    into = ScoreSums.zeros(cov, 1)
    seen = {}

    def done(name):
        assert name not in seen
        seen[name] = [into.squares[name].clone(), into.total[name].clone(), into.signal[name].clone()]

    score_sums(model, ids, attn, resp, signal[None], coverage=cov, into=into, done=done)
    assert set(seen) == set(cov.shapes)
    for name, (sq, tot, sig) in seen.items():
        assert torch.equal(sq, into.squares[name]) and torch.equal(tot, into.total[name]), name
        assert torch.equal(sig, into.signal[name]) and sq.abs().max() > 0, name
