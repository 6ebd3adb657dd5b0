"""Assemble the ``pdflash`` command line.

Each command lives in its own module and is registered here. Expected failures
raise :class:`pdflash.PdflashError`; ``main`` prints them as one ``Error:`` line
on stderr and exits with the error's code. Set PDFLASH_DEBUG=1 for tracebacks.

Exit codes: 0 success; 1 an error found while running, which the message explains
(including an option value that does not fit the given model, files or machine);
2 bad usage: the command line itself is wrong (unknown option, missing argument,
a value outside its allowed range or choices, options that contradict each
other); 3 the command ran but a check it makes did not hold (``smoke``); 130
interrupted (Ctrl-C), after the command printed or saved what it had.

Typer runs in non-standalone mode, so that click's usage errors and Ctrl-C reach
this module instead of being printed as a box or swallowed.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import typer

from pdflash import Interrupted, PdflashError

app = typer.Typer(
    name="pdflash",
    help="Run Mixture-of-Experts models larger than the GPU, with a priority-banded expert fetch scheduler.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# click's exception classes, wherever this Typer takes click from (its own copy or the click package)
_click = importlib.import_module(typer.BadParameter.__module__)
_NO_ARGS = getattr(_click, "NoArgsIsHelpError", ())


def _interruptible(fn):
    """Ctrl-C inside a command becomes :class:`Interrupted` (Typer would turn it into a silent exit)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted("stopped by Ctrl-C") from None

    return wrapper


def _register() -> None:
    from pdflash.cli import bench_priority, build_native, fetch_models, generate, make_synthetic, smoke

    for name, fn in (("generate", generate.generate), ("bench-priority", bench_priority.bench_priority),
                     ("fetch-models", fetch_models.fetch_models), ("make-synthetic", make_synthetic.make_synthetic),
                     ("smoke", smoke.smoke), ("build-native", build_native.build_native)):
        app.command(name)(_interruptible(fn))


def _usage_line(exc) -> str:
    """One line for a click usage error: its message and where to find help."""
    msg = " ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    return f"Error: {msg}{where}"


def _exit(code: int, line: str | None = None) -> None:
    if line is not None:
        print(line, file=sys.stderr)
    sys.exit(code)


def main() -> None:
    debug = os.environ.get("PDFLASH_DEBUG") == "1"
    try:
        _register()
        rv = app(standalone_mode=False, prog_name="pdflash")
    except _NO_ARGS as exc:  # `pdflash` alone: the overview, as bad usage
        _exit(2, exc.format_message())
    except _click.UsageError as exc:
        _exit(2, _usage_line(exc))
    except _click.ClickException as exc:  # other click failures (e.g. a file option that cannot be opened)
        _exit(exc.exit_code, f"Error: {exc.format_message()}")
    except typer.Abort:  # EOF at a prompt
        _exit(1, "Error: aborted")
    except Interrupted as exc:
        _exit(exc.exit_code, f"Interrupted: {exc}")
    except PdflashError as exc:
        if debug:
            raise
        _exit(exc.exit_code, f"Error: {exc}")
    except KeyboardInterrupt:  # outside any command (while starting)
        _exit(130, "Interrupted: stopped by Ctrl-C")
    except Exception as exc:  # torch.OutOfMemoryError, without importing torch here
        if type(exc).__name__ != "OutOfMemoryError" or debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        _exit(1, f"Error: the device ran out of memory ({first}); give a smaller --expert-cache-mib or "
                 "--max-new-tokens, or free the device")
    if rv == 130:  # Typer's answer to a Ctrl-C while it parsed the command line
        _exit(130, "Interrupted: stopped by Ctrl-C")
    if isinstance(rv, int) and rv:
        sys.exit(rv)


if __name__ == "__main__":
    main()
