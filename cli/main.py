"""Assemble the ``pdflash`` command line.

Each command lives in its own module and is registered here. Expected failures
raise :class:`pdflash.PdflashError`; ``main`` prints them as one ``Error:`` line
on stderr and exits with the error's code. Set PDFLASH_DEBUG=1 for tracebacks.

Exit codes: 0 success; 1 an error the message explains; 2 bad usage (unknown
option, bad value); 3 the command ran but a check it makes did not hold
(``smoke``); 130 interrupted.
"""

from __future__ import annotations

import os
import sys

import typer

from pdflash import PdflashError

app = typer.Typer(
    name="pdflash",
    help="Run Mixture-of-Experts models larger than the GPU, with a priority-banded expert fetch scheduler.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from pdflash.cli import bench_priority, build_native, fetch_models, generate, make_synthetic, smoke

    app.command("generate")(generate.generate)
    app.command("bench-priority")(bench_priority.bench_priority)
    app.command("fetch-models")(fetch_models.fetch_models)
    app.command("make-synthetic")(make_synthetic.make_synthetic)
    app.command("smoke")(smoke.smoke)
    app.command("build-native")(build_native.build_native)


def main() -> None:
    _register()
    try:
        app()
    except PdflashError as exc:
        if os.environ.get("PDFLASH_DEBUG") == "1":
            raise
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # torch.OutOfMemoryError, without importing torch here
        if type(exc).__name__ != "OutOfMemoryError" or os.environ.get("PDFLASH_DEBUG") == "1":
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        print(f"Error: the device ran out of memory ({first}); give a smaller --expert-cache-mib or "
              "--max-new-tokens, or free the device", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
