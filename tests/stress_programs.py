"""Build one of native/stress's C programs plainly (the Makefile builds them under the
sanitizers) and run its quick pass: every check must hold."""

import os
import shutil
import subprocess

NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")
COMPILER = shutil.which("cc") or shutil.which("gcc")


def run_quick(tmp_path, program: str, sources: list[str], defines: tuple[str, ...] = ()) -> None:
    """Compile native/stress/<program>.c with the library ``sources`` (relative to native/) and the
    macros ``defines`` (``NAME`` or ``NAME=VALUE``), run it with --quick and assert its last line
    reports passes and no failure."""
    exe = tmp_path / program
    subprocess.run([COMPILER, "-std=c11", "-O2", "-pthread", f"-I{NATIVE}", *(f"-D{d}" for d in defines), "-o", str(exe),
                    os.path.join(NATIVE, "stress", program + ".c"), *(os.path.join(NATIVE, s) for s in sources), "-lm", "-ldl"],
                   check=True)
    out = subprocess.run([str(exe), "--quick", "--seed", "7"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{program}: ") and last.endswith(" 0 failed") and not last.startswith(f"{program}: 0 passed")
