"""Open and validate a Hugging Face checkpoint directory before anything is loaded.

``Checkpoint(path)`` reads config.json, picks the model-family adapter, opens
every safetensors file memory-mapped (``safetensors.safe_open``) and checks
that each tensor the adapter expects exists with the right shape and dtype.
Every problem is a :class:`pdflash.PdflashError` with one line that names the
file and says what to do. Tensors are read on demand with ``get``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdflash import PdflashError
from pdflash.offload.family import SAFETENSORS_DTYPES, ModelFamily, find_family

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class Checkpoint:
    """A validated checkpoint directory; see the module docstring. Call close() when done."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path).expanduser()
        p = self.path
        if not p.exists():
            raise PdflashError(f"{p}: no such directory; pass a checkpoint directory (config.json + *.safetensors)")
        if not p.is_dir():
            raise PdflashError(f"{p} is not a directory; pass the checkpoint directory, not a file in it")
        self.config = _read_config(p)
        self.family: ModelFamily = find_family(self.config, f"{p / 'config.json'}")
        self.weight_map = self._weight_map()
        self._handles = {}
        for fname in sorted(set(self.weight_map.values())):
            f = p / fname
            if not f.is_file():
                raise PdflashError(f"{f} is missing (named in {INDEX_NAME}); download the checkpoint again")
            try:
                self._handles[fname] = safe_open(str(f), framework="pt")
            except Exception as exc:
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise PdflashError(f"{f} is not a readable safetensors file ({msg}); it may be truncated: download it again") from None
        self._check_tensors()

    # -- discovery -------------------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        p = self.path
        index = p / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                wm = data["weight_map"]
                if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                    raise ValueError("weight_map must map tensor names to file names")
            except (ValueError, KeyError, TypeError) as exc:
                raise PdflashError(f"{index} is malformed ({exc}); download the checkpoint again") from None
            return dict(wm)
        single = p / SINGLE_NAME
        if single.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(single), framework="pt") as fh:
                    return {k: SINGLE_NAME for k in fh.keys()}
            except Exception as exc:
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise PdflashError(f"{single} is not a readable safetensors file ({msg}); it may be truncated: download it again") from None
        raise PdflashError(f"{p}: no {SINGLE_NAME} or {INDEX_NAME}; the checkpoint's weights are missing")

    def _check_tensors(self) -> None:
        specs = self.family.tensor_specs()
        missing = [n for n in specs if n not in self.weight_map or n not in self._keys(self.weight_map[n])]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise PdflashError(f"{self.path}: tensor {missing[0]} is missing{more}; the checkpoint is incomplete or not a {self.family.name}")
        for name, spec in specs.items():
            sl = self._handles[self.weight_map[name]].get_slice(name)
            shape, dt = tuple(sl.get_shape()), sl.get_dtype()
            if shape != spec.shape:
                raise PdflashError(
                    f"{self.path / self.weight_map[name]}: tensor {name} has shape {list(shape)} but config.json implies {list(spec.shape)}"
                )
            if dt not in spec.dtypes:
                raise PdflashError(
                    f"{self.path / self.weight_map[name]}: tensor {name} has dtype {dt}, expected {' or '.join(spec.dtypes)}"
                )

    def _keys(self, fname: str) -> set[str]:
        cache = self.__dict__.setdefault("_key_cache", {})
        if fname not in cache:
            cache[fname] = set(self._handles[fname].keys())
        return cache[fname]

    # -- access ----------------------------------------------------------------------
    def dtype(self, name: str) -> torch.dtype:
        dt = self._handles[self.weight_map[name]].get_slice(name).get_dtype()
        return SAFETENSORS_DTYPES[dt]

    def get(self, name: str) -> torch.Tensor:
        """The tensor as a CPU torch tensor (read from the memory map)."""
        try:
            return self._handles[self.weight_map[name]].get_tensor(name)
        except KeyError:
            raise PdflashError(f"{self.path}: tensor {name} is missing") from None
        except Exception as exc:
            raise PdflashError(f"{self.path / self.weight_map[name]}: could not read {name} ({exc})") from None

    @property
    def stored_dtype(self) -> torch.dtype:
        """dtype of the non-expert weights (the default compute dtype)."""
        return self.dtype("model.embed_tokens.weight")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_config(p: Path) -> dict:
    cfg = p / "config.json"
    if not cfg.is_file():
        raise PdflashError(f"{p}: no config.json; is this a Hugging Face checkpoint directory?")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise PdflashError(f"{cfg} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PdflashError(f"{cfg} could not be read ({exc})") from None
    if not isinstance(data, dict):
        raise PdflashError(f"{cfg} must hold a JSON object, got {type(data).__name__}")
    return data
