"""One module per command; each has ``register(subparsers)`` and a handler ``main(args) -> int``.

The one-line help of every command lives here, so the CLI can list the commands (``--help``) and
answer ``--version`` without importing any command module: only the command that runs is
imported, with what it needs (torch, transformers, PEFT).
"""

HELP = {
    "calibrate": 'sample from the model, estimate Fisher, signal scales and bounds',
    "compare": 'show runs side by side: S, checks, top-k mask overlap, module rank correlation',
    "export": 'export a run as axolotl unfrozen_parameters (YAML) or a PEFT adapter-config directory',
    "lora": 'LoRA target modules and per-module ranks by bound mass (a PEFT adapter-config directory)',
    "migrate": "upgrade an older run directory to this release's run format",
    "recipes": 'list the shipped recipes, show one (`recipes show NAME`), or every recipe key (`recipes fields`)',
    "report": 'regenerate report.json, report.md and report.html of a run directory',
    "select": 'select the coordinates fine-tuning is likely to move (a mask file)',
    "validate": "check a run's ranking against a real short fine-tuning (validation.json + plots)",
    "verify": 'compare two run directories tensor by tensor (reproducibility)',
}


def add_command(subparsers, name: str, handler, *, help: str, description: str, run_help: str):
    """A subcommand whose first argument is a run directory."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("run", help=run_help)
    p.set_defaults(func=handler)
    return p
