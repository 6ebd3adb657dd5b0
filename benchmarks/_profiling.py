"""cProfile output shared by the benchmark scripts."""

import cProfile
import io
import pstats
from pathlib import Path


def write_cprofile(prof: cProfile.Profile, path: Path, rows: int = 40) -> None:
    """The profile's top ``rows`` functions by own time, then by cumulative time, as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(rows)
    path.write_text(text.getvalue())
