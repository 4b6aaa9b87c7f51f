"""What FSDP2 (``torch.distributed.fsdp.fully_shard``) does with fisher_select's engine, on CPU with gloo.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/fsdp2_probe.py

It builds its own tiny Llama (the ``llama-untied`` / ``llama-tied`` models of the test suite, same
seed and weights) and batch, so it runs from anywhere. Four checks, each rank printing its own lines (docs/SCALING.md records the output and what it means):

1. training gradients of the sharded model equal a single process's (every rank, same batch);
2. today's ``score_sums`` on the sharded model, each rank scoring its own rows: the accumulators
   it returns are full-shape tensors (the layer hooks see the all-gathered weights), and their sum
   over ranks equals the single-process sums over all rows (fp32 summation order aside);
3. ``generate`` when ranks stop at different lengths: with ``synced_gpus=True`` every rank keeps
   running forwards (FSDP2 all-gathers inside each one) until all are done;
4. ``engine.sharded.score_sums_sharded``: accumulators reduce-scattered to the shard owners layer
   by layer during the backward; this rank's bytes kept and at peak against unsharded ones, and
   the gathered sums against one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from fisher_select.engine.scoring import score_sums
from fisher_select.engine.sharded import score_sums_sharded


def tiny_model(name: str) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 16, vocab 64), head tied or not, weights perturbed by seeded noise."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=name == "llama-tied", eos_token_id=1,
                         bos_token_id=None, pad_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.1 * torch.randn_like(weight))
    return model.eval()


def random_batch(batch: int, length: int = 10):
    """ids, attention mask, response mask (B, T) and a signal (B,); rows 1 and 2 left-padded by 3 and 1."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (batch, length), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, :3] = attn[2, :1] = 0
    ids[attn == 0] = 1  # the pad id
    resp = torch.arange(length).expand(batch, length) > length // 2
    resp = resp.clone()
    resp[-1, -1] = False  # one row with a shorter response
    return ids, attn, resp, torch.randn(batch, generator=gen)


def sharded(mesh, name="llama-untied"):
    model = tiny_model(name)  # same seed on every rank: the same weights
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    say = lambda text: print(f"rank {rank}: {text}", flush=True)  # noqa: E731

    ids, attn, resp, signal = random_batch(batch=2 * world)
    ref = tiny_model("llama-untied")
    ref(input_ids=ids, labels=ids).loss.backward()
    model = sharded(mesh)
    model(input_ids=ids, labels=ids).loss.backward()
    diff = max(float((p.grad.full_tensor() - q.grad).abs().max())
               for p, q in zip(model.parameters(), ref.parameters()))
    say(f"1. training gradients vs 1 process: max |diff| {diff:.3e}")

    single = score_sums(tiny_model("llama-untied"), ids, attn, resp, signal)
    rows = slice(2 * rank, 2 * rank + 2)  # this rank's own samples
    mine = score_sums(sharded(mesh), ids[rows], attn[rows], resp[rows], signal[rows])
    kinds = {type(t).__name__ for t in mine.squares.values()}
    full = all(tuple(t.shape) == tuple(single.squares[n].shape) for n, t in mine.squares.items())
    worst = 0.0
    for name, t in mine.squares.items():
        summed = t.clone()
        dist.all_reduce(summed)
        scale = float(single.squares[name].abs().max()) or 1.0
        worst = max(worst, float((summed - single.squares[name]).abs().max()) / scale)
    say(f"2. score_sums accumulators: {sorted(kinds)}, full shape on every rank: {full}; "
        f"all-reduced vs 1 process: max relative diff {worst:.3e}")

    torch.manual_seed(rank)
    prompt = torch.randint(2, 64, (2, 5 + rank))
    out = sharded(mesh).generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                 max_new_tokens=8 - 4 * rank, synced_gpus=True, pad_token_id=1)
    say(f"3. generate with synced_gpus=True, {8 - 4 * rank} new tokens asked: output {tuple(out.shape)}")

    for name in ("llama-untied", "llama-tied"):
        for mode, kwargs in (("full", {"objectives": 1}), ("fisher", {"totals": False})):
            want = score_sums(tiny_model(name), ids, attn, resp, signal if mode == "full" else None)
            batch = (ids[rows], attn[rows], resp[rows]) + ((signal[rows],) if mode == "full" else ())
            got = score_sums_sharded(sharded(mesh, name), [batch], **kwargs)
            whole = got.gather()
            worst = 0.0
            if whole is not None:
                for n, t in whole.squares.items():
                    scale = float(want.squares[n].abs().max()) or 1.0
                    worst = max(worst, float((t - want.squares[n]).abs().max()) / scale)
            say(f"4. score_sums_sharded {name}, accumulators={mode}: kept {got.nbytes()} B, peak {got.peak_bytes} B, "
                f"unsharded {got.full_bytes} B" + (f"; gathered F vs 1 process: max relative diff {worst:.3e}"
                                                    if whole is not None else ""))
    dist.barrier()  # a gloo rank exiting while its peer still works sometimes aborts at exit (SIGABRT)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
