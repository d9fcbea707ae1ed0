"""The `quickdraft` command line (typer + rich): the app and its commands, one module each.

Every user error (missing folder, unreadable config, vocabulary mismatch, bad parameter)
is one line on stderr and exit code 2, never a traceback. Command modules import
`cli.common`, never this module.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from ..errors import QuickdraftError
from .bench import bench_command
from .bench_serve import bench_serve_command
from .common import err, fail
from .generate import generate
from .models import convert_command, models_command, pull_command
from .select import select_command
from .serve import serve_command
from .train import distill_command, train_command, train_eagle3_command
from .tune import tune_command
from .verify import verify_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="quickdraft: lossless speculative decoding for Llama-family models.")

for _name, _command in (("generate", generate), ("train", train_command), ("distill", distill_command),
                        ("train-eagle3", train_eagle3_command), ("verify", verify_command), ("tune", tune_command), ("select", select_command), ("bench", bench_command),
                        ("serve", serve_command), ("bench-serve", bench_serve_command), ("models", models_command),
                        ("pull", pull_command), ("convert", convert_command)):
    app.command(_name)(_command)


@app.command("train-eagle", hidden=True,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def _renamed_train_eagle() -> None:
    """The old name of train-eagle3 (not listed in --help): a clear error naming the new one."""
    fail("`quickdraft train-eagle` is now `quickdraft train-eagle3` (same options)")


@app.callback()
def _root() -> None:
    """quickdraft: lossless speculative decoding for Llama-family models."""


def main() -> None:
    try:
        app()  # typer reports usage errors itself (exit code 2)
    except QuickdraftError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
