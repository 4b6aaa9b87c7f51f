"""One module per command; each has ``register(subparsers)`` and a handler ``main(args) -> int``."""


def add_command(subparsers, name: str, handler, *, help: str, description: str, run_help: str):
    """A subcommand whose first argument is a run directory."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("run", help=run_help)
    p.set_defaults(func=handler)
    return p
