"""Make ``pdflash`` importable from this checkout when it is not installed (benchmark scripts)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_pdflash() -> None:
    try:
        import pdflash  # noqa: F401
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location("pdflash", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pdflash"] = mod
        spec.loader.exec_module(mod)
