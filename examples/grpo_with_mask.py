"""Calibrate -> select (or LoRA hint) -> a few TRL GRPO steps, on the embedded default, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python examples/grpo_with_mask.py --out runs/grpo-example
    HF_HUB_OFFLINE=1 .venv/bin/python examples/grpo_with_mask.py --out runs/grpo-example --lora --reuse

Needs the test extra (``scripts/setup.sh --test`` installs trl). Steps:

1. ``rl-arithmetic`` recipe (SmolLM2-135M-Instruct, arithmetic word problems, reward 1 when the
   last number of the response is the answer), shrunk by the flags, written to ``--out``.
2. ``--top`` coordinates by bound -> ``FisherMaskCallback`` (masked full fine-tuning), or with
   ``--lora`` the LoRA hint's ``LoraConfig`` -> ``peft_config=``.
3. GRPO on the same prompts with the same reward (``numeric_match`` on the recipe's ``answer``
   field), TRL's AdamW with weight decay, full-distribution sampling at temperature 1 (TRL's
   ``top_k=0``, as calibration samples). Masked mode then checks that every masked coordinate is
   bit-identical and counts the selected ones that moved.

Measured on a shared 2-core CPU (load average about 7, so read these as upper bounds): the
defaults took 820 s wall (470 s CPU), of which calibration 579 s; ``--lora --reuse`` on that run
took 210 s. The sizes (two steps, four prompts) only show the plumbing, not a useful training run;
a step whose group of rewards is constant has no gradient, and only weight decay moves weights. The bound is for one step in expectation: under AdamW the mask is what keeps coordinates still,
not the bound (docs/TRAPS.md, "Adam is not SGD").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fisher_select.calibration.prompts import PromptRecord, load_prompts  # noqa: E402
from fisher_select.calibration.rewards import numeric_match  # noqa: E402
from fisher_select.recipe import find_recipe, load_recipe  # noqa: E402
from fisher_select.models import EMBEDDED_DEFAULT, load_model  # noqa: E402
from fisher_select.outputs.lora import lora_config  # noqa: E402
from fisher_select.outputs.masks import select_masks  # noqa: E402
from fisher_select.training.callback import FisherMaskCallback  # noqa: E402
from fisher_select.pipeline import run_recipe  # noqa: E402
from fisher_select.run.load import load_run  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/grpo-example", help="run directory to write (replaced if present)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts for calibration and for GRPO")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="calibration samples per prompt (K)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="response length, calibration and GRPO")
    p.add_argument("--top", type=float, default=0.05, help="share of coordinates the mask lets move")
    p.add_argument("--lora", action="store_true", help="train the LoRA hint's adapters instead of a mask")
    p.add_argument("--steps", type=int, default=2, help="GRPO optimizer steps")
    p.add_argument("--reuse", action="store_true", help="use the run already in --out instead of calibrating again")
    return p.parse_args(argv)


def arithmetic_reward(answer_field: str = "answer"):
    """The recipe's reward as a TRL reward function (TRL passes dataset columns as keyword lists)."""
    reward = numeric_match(answer_field)

    def score(prompts, completions, **columns) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat or plain
        return [reward(PromptRecord(i, None, None, {answer_field: a}), text)
                for i, (text, a) in enumerate(zip(texts, columns[answer_field]))]

    score.__name__ = f"numeric_match_{answer_field}"
    return score


def check_movement(model, trainer, before: dict, masks: dict | None) -> int:
    """0 when nothing that must stay still moved: no masked coordinate (masks), no base weight (LoRA); else 1."""
    if masks is not None:
        masked_moved = selected_moved = selected = 0
        for name, p in model.named_parameters():
            changed = p.detach() != before[name]
            masked_moved += int(changed[~masks[name]].sum())
            selected_moved += int(changed[masks[name]].sum())
            selected += int(masks[name].sum())
        print(f"masked coordinates moved: {masked_moved} (must be 0); selected moved: {selected_moved:,} of {selected:,}")
        if masked_moved:
            print("error: the mask did not hold", file=sys.stderr)
            return 1
    else:
        base_moved = sum(int((p.detach() != before[n.replace('.base_layer', '')]).sum())
                         for n, p in trainer.model.get_base_model().named_parameters() if "lora_" not in n)
        print(f"base weights moved: {base_moved} (must be 0)")
        if base_moved:
            return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    recipe = load_recipe(find_recipe("rl-arithmetic"), overrides={
        "num_prompts": args.num_prompts, "samples_per_prompt": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens})
    if args.reuse:
        load_run(args.out)  # refuses a directory that is not a run
        print(f"reusing the run in {args.out}")
    else:
        run_recipe(recipe, args.out, overwrite=True, progress=False)
        print(f"[{time.perf_counter() - started:5.1f}s] calibrated -> {args.out}")

    model, tokenizer, _ = load_model(EMBEDDED_DEFAULT)  # the same weights: the fingerprint check passes
    # Conversational prompts: TRL applies the chat template as calibration did (one user turn).
    records = load_prompts(recipe.prompts, limit=args.num_prompts)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r.prompt}], "answer": r.fields["answer"]}
                              for r in records])
    callbacks, peft_config, masks = [], None, None
    if args.lora:
        peft_config = lora_config(args.out, top_n=8, total_rank=64)
        print(f"LoRA targets: {', '.join(sorted(peft_config.target_modules))}")
    else:
        maskset = select_masks(args.out, top=args.top)
        masks = maskset.masks
        callbacks.append(FisherMaskCallback(maskset))  # fingerprint-checked against the trainer's model
        print(f"mask: {maskset.selected:,} of {maskset.numel:,} coordinates may move ({maskset.density:.2%})")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    generations = min(4, args.samples_per_prompt * 2)
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "grpo"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        max_steps=args.steps, per_device_train_batch_size=2 * generations, num_generations=generations,
        max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=1e-5, weight_decay=0.1,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward(), args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    trainer.train()
    for row in trainer.state.log_history:
        if "reward" in row:
            print(f"step {row['step']}: reward {row['reward']:.3f} (std {row['reward_std']:.3f}), "
                  f"grad norm {row['grad_norm']:.4g}")

    if check_movement(model, trainer, before, masks):
        return 1
    print(f"[{time.perf_counter() - started:5.1f}s] done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
