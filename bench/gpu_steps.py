"""The steps of bench/gpu_check.sh: one subcommand per step, each writing one JSON file.

Every step goes through the existing bench scripts' code paths (bench_engine's modes and tables,
bench_sampling's and bench_sparse's ``main``) with sizes chosen here: real sizes on ``cuda``, tiny ones
with ``--smoke`` on the CPU. A step rewrites its JSON file (atomically) after each part it finishes,
so a step cut off by its timeout still leaves what it measured.

    python bench/gpu_steps.py env --out gpu-check/env.json
    python bench/gpu_steps.py big --out gpu-check/big.json [--smoke]
    python bench/gpu_steps.py table|sampling|sparse --out FILE [--smoke] [--gguf FILE]
    python bench/gpu_steps.py demo --out FILE --gguf FILE [--smoke]
    python bench/gpu_steps.py summary DIR        # the returned files, one line per figure
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

# docs/BENCHMARKS.md, "The demo calibration, phase by phase": `make demo` on the 2-core x86-64 CPU
# machine (24 GB, no GPU), 2026-12-04, report.json timings (seconds).
CPU_DEMO = {"machine": "2-core x86-64 CPU, 24 GB, no GPU (docs/BENCHMARKS.md, 2026-12-04)", "wall_s": 251.9,
            "phases_s": {"setup": 0.0, "model load": 3.9, "sampling": 53.1, "scoring": 181.7, "checks": 4.8,
                         "report": 1.9, "writing": 6.4}}
PACKAGES = ("torch", "transformers", "peft", "accelerate", "safetensors", "scipy", "matplotlib", "numpy", "pyyaml",
            "tqdm", "psutil", "gguf", "trl", "bitsandbytes")


def save(path: str, data: dict) -> None:
    """Write JSON atomically: a step killed mid-write leaves the previous version, never half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def sizes(smoke: bool) -> dict:
    """Every size the steps use: the real ones (cuda, bf16) or --smoke's tiny ones (cpu, fp32)."""
    if smoke:
        return dict(device="cpu", dtype="float32", rounds=1, big=["tiny-llama", "tiny-moe"], batch=2, length=32,
                    response=16, long_batch=2, long_prompt=8, long_response=48, long_budget=64, default="tiny-smollm2",
                    table=[("float32", 2)], table_len=(24, 8), sweep=["8", "16"], sweep_prompt="8",
                    sparse=["--shape", "tiny-llama", "--dtype", "float32", "--batch", "2", "--seq-len", "16"],
                    sampling=["--batch", "4", "--k", "2", "--batches", "1", "--max-new-tokens", "4"],
                    demo=["--num-prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4"])
    return dict(device="cuda", dtype="bfloat16", rounds=3, big=["llama3-8b", "qwen3-moe"], batch=4, length=512,
                response=256, long_batch=2, long_prompt=64, long_response=2048, long_budget=0, default="smollm2-135m",
                table=[("bfloat16", 8), ("bfloat16", 16), ("float32", 8), ("float32", 16)], table_len=(128, 64),
                sweep=["32", "64", "128", "256", "512"], sweep_prompt="64",
                sparse=["--shape", "llama3-8b", "--dtype", "bfloat16", "--batch", "4", "--seq-len", "512"],
                sampling=["--batch", "32", "--k", "8", "--batches", "1", "--max-new-tokens", "64", "--rounds", "2"],
                demo=[])


def engine_args(s: dict, model: str, **kw) -> argparse.Namespace:
    """bench_engine's arguments for one table (its own parser, so every default is the script's)."""
    import bench_engine

    args = bench_engine.parse_args(["--model", model, "--device", s["device"], "--dtype", s["dtype"],
                                    "--rounds", str(s["rounds"]), "--max-peer-gb", "0", "--budget-squares"])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def step_env(opts) -> None:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "cpus": os.cpu_count(), "packages": versions, "torch_cuda": torch.version.cuda, "cuda_available": cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "fisher_select": importlib.import_module("fisher_select").__file__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    save(opts.out, info)
    info["cuda_vs_cpu"] = device_vs_cpu("cuda" if cuda else "cpu", "tiny-smollm2" if opts.smoke else "tiny")
    save(opts.out, info)
    print(json.dumps(info, indent=1))


def device_vs_cpu(device: str, name: str) -> dict:
    """score_sums on the device against the CPU on the same fp32 batch, one row left padded as calibrate
    scores them: the worst relative error of every sum (the device's kernels against the reference's)."""
    import bench_engine
    from fisher_select.engine.scoring import score_sums

    model = bench_engine.build_model(name, "cpu", torch.float32)
    batch = bench_engine.make_batch(model.config.vocab_size, 4, 64, 32, "cpu")
    batch.mask[1, :5] = 0
    batch.resp[1, :5] = False
    want = score_sums(model, batch.ids, batch.mask, batch.resp, batch.signal)
    model = model.to(device)
    got = score_sums(model, *(t.to(device) for t in (batch.ids, batch.mask, batch.resp, batch.signal)))
    worst = {kind: max(float((getattr(got, kind)[n].cpu() - w).abs().max() / w.abs().max().clamp_min(1e-30))
                       for n, w in getattr(want, kind).items()) for kind in ("squares", "signal", "total")}
    return {"device": device, "model": name, "batch": "4 x 64 (32 response), one row left padded", "dtype": "float32",
            "max_relative_error": worst}


def memory_estimate(model, batch_rows: int, tokens: int, max_tokens: int | None) -> dict:
    """calibrate's own estimate (calibration.budget.estimate_memory) for accumulators=fisher, one objective,
    no stability half: the memory mode the big shapes are measured in."""
    from fisher_select.calibration.budget import estimate_memory
    from fisher_select.engine.memory import MemoryMode

    covered = sum(p.numel() for p in model.parameters())
    est = estimate_memory(model, MemoryMode("fisher"), covered, objectives=1, stability=False,
                          sample_rows=batch_rows, score_rows=batch_rows, tokens=tokens, max_tokens=max_tokens)
    mib = 2**20
    return {"weights_mib": est.weights / mib, "accumulators_mib": est.accumulators / mib,
            "scoring_mib": est.scoring / mib, "sampling_mib": est.sampling / mib, "detail": est.detail}


def one_big_table(model, s: dict, name: str, rows: int, prompt: int, response: int, modes: list[str],
                  budget: int) -> dict:
    """bench_engine's table (interleaved rounds, memory probe) for one model, with calibrate's estimate."""
    import bench_engine

    model.zero_grad(set_to_none=True)  # the previous table's floor .grad: 16 GB on the 8B shape
    free_memory(s["device"])
    args = engine_args(s, name, batch=rows, length=prompt + response, response=response, max_batch_tokens=budget)
    batch = bench_engine.make_batch(model.config.vocab_size, rows, prompt + response, response, s["device"])
    table = bench_engine.as_json(bench_engine.describe(model, batch, args),
                                 bench_engine.run_table(model, batch, args, modes))
    bench_engine.print_table(table)
    auto = bench_engine.auto_max_tokens(model)
    table["estimate_whole_batch"] = memory_estimate(model, rows, prompt + response, None)
    table["estimate_budget"] = memory_estimate(model, rows, prompt + response, budget or auto)
    table["budget_tokens"] = budget or auto
    if s["device"] == "cuda":
        table["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return table


def step_big(opts) -> None:
    """Engine overhead and memory at real sizes: the 8B shape at batch x length, then with long (2k-token)
    responses through --max-batch-tokens; the MoE shape with its fallback parameters named."""
    import bench_engine
    from fisher_select.engine.scoring import plan_coverage

    s = sizes(opts.smoke)
    out = {"sizes": {k: s[k] for k in ("device", "dtype", "batch", "length", "response", "long_batch",
                                        "long_response")}}
    for name in s["big"]:
        t0 = time.perf_counter()
        model = bench_engine.build_model(name, s["device"], getattr(torch, s["dtype"]))
        cov = plan_coverage(model)
        entry = out[name] = {"build_s": time.perf_counter() - t0, "parameters": sum(p.numel() for p in model.parameters()),
                             "fallback": sorted(cov.fallback),
                             "fallback_parameters": sum(p.numel() for p in cov.fallback.values())}
        print(f"{name}: {entry['parameters'] / 1e9:.3f} B parameters, {len(entry['fallback'])} on the fallback")
        # accumulators=fisher (squares alone): 4 bytes per parameter, what fits beside 8B bf16 weights and .grad
        entry["table"] = one_big_table(model, s, name, s["batch"], s["length"] - s["response"], s["response"],
                                       ["floor", "squares"], 0)
        save(opts.out, out)
        if name == s["big"][0]:  # long responses: the token budget splits each row's pass
            entry["long"] = one_big_table(model, s, name, s["long_batch"], s["long_prompt"], s["long_response"],
                                          ["budget", "floor"], s["long_budget"])
            save(opts.out, out)
        del model, cov
        free_memory(s["device"])


def free_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def step_table(opts) -> None:
    """The engine table on the embedded default's shape (dtypes x batches) and the length sweep."""
    import bench_engine

    s = sizes(opts.smoke)
    length, response = s["table_len"]
    out = {"tables": {}, "sweep_length": None}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, batch in s["table"]:
            path = f"{tmp}/table.json"
            bench_engine.main(["--model", s["default"], "--device", s["device"], "--dtype", dtype, "--batch", str(batch),
                               "--length", str(length), "--response", str(response), "--rounds", str(s["rounds"]),
                               "--modes", "floor,scoring,budget,loop", "--json", path])
            out["tables"][f"{dtype}-{batch}"] = json.load(open(path))
            save(opts.out, out)
        path = f"{tmp}/sweep.json"
        bench_engine.main(["--model", s["default"], "--device", s["device"], "--dtype", "float32", "--sweep", "length",
                           "--batch", str(s["table"][0][1]), "--rounds", str(s["rounds"]), "--prompt", s["sweep_prompt"],
                           "--modes", "floor,scoring,budget,loop,loop_sums", "--values", *s["sweep"], "--json", path])
        out["sweep_length"] = json.load(open(path))
        save(opts.out, out)


def step_sampling(opts) -> None:
    """fisher_select's sampler against HF generate, same prompts, on the real weights (EOS needs them)."""
    import bench_sampling

    s = sizes(opts.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        bench_sampling.main(["--model", opts.gguf, "--device", s["device"], "--rounds", str(s["rounds"]),
                             *s["sampling"], "--json", f"{tmp}/s.json"])
        save(opts.out, json.load(open(f"{tmp}/s.json")))


def step_sparse(opts) -> None:
    """One AdamW step at 1% (sparse deltas) against full fine-tuning; full's OOM is a result."""
    import bench_sparse

    s = sizes(opts.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        bench_sparse.main([*s["sparse"], "--device", s["device"], "--densities", "0.01", "--modes", "sparse", "full",
                           "--steps", "2", "--rounds", "1", "--json", f"{tmp}/s.json"])
        save(opts.out, json.load(open(f"{tmp}/s.json")))


def step_demo(opts) -> None:
    """The demo calibration (make demo's recipe) on the real weights, its report.json timings beside the CPU's."""
    s = sizes(opts.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fisher_select", "calibrate", "--recipe", "recipes/rl-arithmetic-graded.yaml",
               "--model", opts.gguf, "--device", s["device"], *s["demo"], "--no-progress", "--out", f"{tmp}/run"]
        print("+ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        report = json.load(open(f"{tmp}/run/report.json"))
    timings = report.get("timings") or {}
    out = {"command": " ".join(cmd[1:]), "process_wall_s": wall, "timings": timings, "cpu": CPU_DEMO,
           "smoke": opts.smoke, "num_samples": report.get("num_samples")}
    if not opts.smoke and timings.get("wall_s"):
        out["speedup_vs_cpu"] = CPU_DEMO["wall_s"] / timings["wall_s"]
    save(opts.out, out)
    print(json.dumps(out, indent=1))


def summary(folder: str) -> list[str]:
    """One line per measured figure, from whatever JSON files a (possibly cut-off) run returned."""
    def load(name):
        path = os.path.join(folder, name)
        return json.load(open(path)) if os.path.exists(path) else None

    def ratios(table):
        return ", ".join(f"{m} {r['vs_floor']:.2f}x ({r['transient_mib']:.0f} MiB peak)" if r["vs_floor"] else
                         f"{m} {r['error'] or '-'}" for m, r in table["modes"].items())

    lines = []
    env = load("env.json") or {}
    lines.append(f"# {env.get('gpu') or 'cpu'}, torch {env.get('packages', {}).get('torch')}, {env.get('date_utc')}; "
                 f"score_sums vs cpu: {(env.get('cuda_vs_cpu') or {}).get('max_relative_error')}")
    for name, entry in (load("big.json") or {}).items():
        for part in ("table", "long"):
            if isinstance(entry, dict) and part in entry:
                t = entry[part]
                m = t["meta"]
                lines.append(f"{name} {part} ({m['batch']} x {m['length']}, budget {t['budget_tokens']}): {ratios(t)}; "
                             f"estimate: scoring {t['estimate_whole_batch']['scoring_mib']:.0f} MiB whole batch, "
                             f"{t['estimate_budget']['scoring_mib']:.0f} MiB in budget; "
                             f"{len(entry['fallback'])} fallback parameters")
    table = load("table.json") or {}
    for key, t in (table.get("tables") or {}).items():
        lines.append(f"default shape {key}: {ratios(t)}; {t.get('acceptance') or ''}")
    for t in ((table.get("sweep_length") or {}).get("tables") or []):
        lines.append(f"length {t['value']}: {ratios(t)}")
    for r in (load("sparse.json") or {}).get("rows", []):
        lines.append(f"sparse {r['mode']} {r['density']}: " + (r.get("error") or
                     f"step {r['step_s'] * 1e3:.0f} ms, peak {(r['cuda_peak'] or r['peak_rss']) / 2**30:.2f} GiB"))
    for m, r in ((load("sampling.json") or {}).get("modes") or {}).items():
        lines.append(f"sampling {m}: {r['median_tokens_per_s']:.0f} tokens/s, {r['vs_hf_generate']:.2f}x hf_generate")
    demo = load("demo.json")
    if demo:
        lines.append(f"demo: {demo['timings'].get('wall_s')} s wall (CPU {demo['cpu']['wall_s']} s): "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in demo["timings"].get("phases_s", {}).items()))
    return lines


STEPS = {"env": step_env, "big": step_big, "table": step_table, "sampling": step_sampling, "sparse": step_sparse,
         "demo": step_demo}


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["summary"] or argv and argv[0] == "summary":
        print("\n".join(summary((argv or sys.argv[1:])[1])))  # python bench/gpu_steps.py summary DIR
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=list(STEPS))
    ap.add_argument("--out", required=True, help="the step's JSON file")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (bench/gpu_check.sh --cpu-smoke)")
    ap.add_argument("--gguf", help="the embedded default's GGUF (sampling, demo)")
    opts = ap.parse_args(argv)
    if opts.step in ("sampling", "demo") and not (opts.gguf and os.path.isfile(opts.gguf)):
        ap.error(f"{opts.step} needs the real weights: --gguf {opts.gguf} is not a file (was the two-part transfer "
                 "reassembled? see docs/GPU.md)")
    STEPS[opts.step](opts)


if __name__ == "__main__":
    main()
