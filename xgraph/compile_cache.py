"""A per-machine cache of compiled forwards: compile once, start fast in every later process.

    cache = CompileCache.for_model(model_class="Qwen3ForCausalLM", config=cfg.to_dict(),
                                   dtype=torch.bfloat16, device=backend.device)
    cache.load()          # before the first compile: torch.compile then finds its results
    ...                   # compile and run
    cache.save()          # after it: what this process compiled, for the next one

What is kept is torch.compile's own artifacts (Inductor's FX graphs and generated kernels,
AOTAutograd's graphs, autotuning results), serialized by `torch.compiler.save_cache_artifacts`
and loaded into a fresh process's compiler caches by `load_cache_artifacts`: Dynamo still
traces the forward (seconds), but nothing is lowered, code-generated or autotuned again.

One file per key. The key is a digest of everything the compiled code depends on: the
model's class and configuration, the dtype, the device (type, name, compute capability),
the compile settings, and the versions of torch, Triton, Python and xgraph, so a changed
model, dtype, torch or xgraph version never loads a stale artifact: it misses and compiles.
The file holds the key's fields too; a file whose fields differ (copied from elsewhere), or
that cannot be read or loaded (truncated, corrupt), is ignored with one warning and the
process compiles as if there were none; it is never an error.

Where: `directory=` (GraphModel(compile_cache=...), `xgraph generate --compile-cache`), else
the environment variable XGRAPH_COMPILE_CACHE, else `$XDG_CACHE_HOME/xgraph/compile` (by
default `~/.cache/xgraph/compile`). "off" (or an empty value) turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import struct
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import XGraphError, XGraphWarning

logger = logging.getLogger("xgraph")

ENV = "XGRAPH_COMPILE_CACHE"
OFF = ("off", "none", "0", "false", "")
MAGIC = b"XGCC1\n"  # file layout: MAGIC, u32 length of the fields' JSON, the JSON, artifacts
SUFFIX = ".xgcc"


def cache_directory(directory: str | os.PathLike[str] | bool | None = None) -> Path | None:
    """Where compiled artifacts live: `directory`, else $XGRAPH_COMPILE_CACHE, else the user
    cache folder; None where the cache is off (False, or "off" in either place)."""
    if directory is False:
        return None
    if directory is None or directory is True:
        env = os.environ.get(ENV)
        if env is not None:
            return None if env.strip().lower() in OFF else Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "xgraph" / "compile"
    text = os.fspath(directory)
    if text.strip().lower() in OFF:
        return None
    return Path(text).expanduser()


def _versions() -> dict[str, str]:
    try:
        import triton  # optional: CPU builds of torch have none

        tv = str(triton.__version__)
    except Exception:  # an absent or broken Triton is a fact of the key, never an error
        tv = "none"
    from . import __version__

    return {
        "torch": torch.__version__,
        "triton": tv,
        "python": platform.python_version(),
        "xgraph": __version__,
    }


def _device_fields(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"type": device.type}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["name"] = torch.cuda.get_device_name(index)
        out["capability"] = list(torch.cuda.get_device_capability(index))
    elif device.type == "cpu":
        out["machine"] = platform.machine()
    return out


def _jsonable(value: Any) -> Any:
    """The key's fields as plain JSON (dtypes, devices and other objects by their text)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass
class CompileCache:
    """The compiled artifacts of one model on this machine (see the module docstring)."""

    directory: Path | None
    fields: dict[str, Any]
    loaded: bool = False
    saved: bool = False
    problem: str | None = None  # why a file was ignored, if one was
    _warned: bool = field(default=False, repr=False)

    @classmethod
    def for_model(
        cls,
        *,
        model_class: str,
        config: Mapping[str, Any],
        dtype: torch.dtype,
        device: torch.device,
        settings: Mapping[str, Any] | None = None,
        directory: str | os.PathLike[str] | bool | None = None,
    ) -> CompileCache:
        """The cache of a model: `config` its configuration (a dict), `settings` how it is
        compiled (backend, dynamic, max tokens, Inductor settings)."""
        fields = {
            "model_class": model_class,
            "config": _jsonable(config),
            "dtype": str(dtype),
            "device": _device_fields(torch.device(device)),
            "settings": _jsonable(settings or {}),
            "versions": _versions(),
        }
        return cls(cache_directory(directory), fields)

    @property
    def key(self) -> str:
        text = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def path(self) -> Path | None:
        return self.path_of()

    def load(self) -> bool:
        """Load this key's artifacts into the compiler's caches; False where there is no
        file or it was ignored (warned once)."""
        payload = self.read()
        if payload is None:
            return False
        if _hot_load(payload) is None:
            self.ignore("", XGraphError("torch could not read the artifacts in it"))
            return False
        self.loaded = True
        logger.info("compile cache: loaded %s (%d bytes)", self.path, len(payload))
        return True

    def save(self) -> bool:
        """Write what this process has compiled so far under this key (atomically: a reader
        never sees half a file); False where the cache is off or nothing was compiled."""
        if self.directory is None:
            return False
        got = torch.compiler.save_cache_artifacts()
        if not got or not got[0]:
            return False
        if not self.write(got[0]):
            return False
        self.saved = True
        return True

    def path_of(self, part: str = "") -> Path | None:
        """The file of this key's `part` ("": torch.compile's artifacts; others name what
        else is kept under the key, such as a precompiled forward)."""
        if self.directory is None:
            return None
        return self.directory / f"{self.key}{'-' + part if part else ''}{SUFFIX}"

    def read(self, part: str = "") -> bytes | None:
        """The payload of this key's `part`; None where there is none, or the file is
        ignored (unreadable, truncated, another key's fields: warned once)."""
        path = self.path_of(part)
        if path is None or not path.is_file():
            return None
        try:
            fields, payload = _read(path)
            if fields != self.fields:
                raise XGraphError(f"its fields are another model's or setup's ({path.name})")
        except Exception as exc:  # a bad file costs a compile, never the process
            self._ignore(path, exc)
            return None
        return payload

    def write(self, payload: bytes, part: str = "") -> bool:
        """Keep `payload` as this key's `part`, atomically; False where the cache is off or
        the disk refused (warned once: later processes compile again)."""
        path = self.path_of(part)
        if path is None:
            return False
        header = json.dumps(self.fields, sort_keys=True).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            os.replace(tmp, path)
        except OSError as exc:  # a read-only or full disk: the next start compiles again
            self._warn(f"could not write {path} ({exc}); later processes will compile again")
            return False
        logger.info("compile cache: wrote %s (%d bytes)", path, len(payload))
        return True

    def ignore(self, part: str, exc: BaseException) -> None:
        """A `part` read whole but unusable (torch refused it): ignored, warned once."""
        self._ignore(self.path_of(part), exc)

    def stats(self) -> dict[str, Any]:
        return {
            "directory": None if self.directory is None else str(self.directory),
            "key": self.key,
            "loaded": self.loaded,
            "saved": self.saved,
            "ignored": self.problem,
        }

    def _ignore(self, path: Path | None, exc: BaseException) -> None:
        self.problem = f"{type(exc).__name__}: {exc}"
        self._warn(
            f"ignored {path} ({self.problem}); compiling as if it were absent. Delete the "
            f"file, or set {ENV}=off to run without the cache."
        )

    def _warn(self, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        msg = f"compile cache: {what}"
        warnings.warn(msg, XGraphWarning, stacklevel=3)
        logger.warning(msg)


def _hot_load(payload: bytes) -> Any:
    """torch.compiler.load_cache_artifacts, its own log of a bad payload kept quiet (the
    cache warns once itself)."""
    torch_log = logging.getLogger("torch.compiler._cache")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)
    try:
        return torch.compiler.load_cache_artifacts(payload)
    finally:
        torch_log.setLevel(level)


def _read(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise XGraphError("not an xgraph compile-cache file")
    at = len(MAGIC)
    (n,) = struct.unpack("<I", data[at : at + 4])
    header = data[at + 4 : at + 4 + n]
    if len(header) != n:
        raise XGraphError("the file is truncated")
    return json.loads(header), data[at + 4 + n :]


def describe(cache: CompileCache | None) -> str:
    """One line for logs and the command line."""
    if cache is None or cache.directory is None:
        return "compile cache: off"
    state = "loaded" if cache.loaded else ("ignored" if cache.problem else "empty")
    return f"compile cache: {cache.path} ({state})"


__all__ = ["ENV", "CompileCache", "cache_directory", "describe"]
