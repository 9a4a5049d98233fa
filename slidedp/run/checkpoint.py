"""Checkpoints: the engine's host state (and what a job adds) in safetensors and JSON, atomically.

A checkpoint is a folder:

    manifest.json                    size and sha256 of every other file (written last)
    engine.json                      AdamW step, skipped steps, optimizer, precision, parameter layout
    state/layer-00000.safetensors    master, exp_avg, exp_avg_sq of layer 0 (flat fp32), one file a layer
    state/layer-00000.host-001-of-002.safetensors
                                     ... or, written by several hosts, one file a layer and host: the
                                     element runs of the layer that host held, packed
    frozen.safetensors               parameters that are not trained (only when there are some)
    rng.safetensors, rng.json        torch generator states (uint8 tensors); Python and NumPy states
    plan.json                        the plan (`Plan.save`)
    hf/config.json, ...              the model's Hugging Face config and generation config, if it has one

A job adds its own files (the train job: `trainer_state.json` and the tokenizer in `hf/`) before the
manifest is written. Nothing is pickled: tensors go into safetensors, everything else into JSON.

Writing (`atomic_checkpoint`): into a temporary sibling folder; each file is hashed while it is
written and fsynced; the manifest comes last; the folder is fsynced, renamed into place and its
parent fsynced. A crash leaves the previous checkpoint or the new one, never half of one.
Loading (`verify_checkpoint`) checks every file's size and sha256 against the manifest before
anything is changed, so a truncated or altered file is refused with its name.

The layer files are written from, and read back into, the host state's own memory: no copy of the
state is made, whatever the model size. The state of layers kept on the device alone (lean layers,
backend/state/host_state.py) goes between the device and the files through a bounded host staging
buffer (backend/state/staging.py), in the same format.

engine.json records, per layer, its "pieces": each file with the element runs [lo, hi) of the layer
it holds, packed in that order (absent: the one file of the whole layer). A host reads the runs it
holds from whichever pieces cover them, so a checkpoint written by N hosts loads on M hosts
(resharding), one host included.

Several hosts (`write_sharded_checkpoint`): the checkpoint folder is on a file system every host
sees (shared). Rank 0 makes the temporary folder; each host's first rank writes that host's layer
files into it; once every host has finished (a rendezvous through the process group), rank 0
writes the rest, lists every host's files in the manifest and commits the folder. A host that fails
leaves nothing: the temporary folder is removed and every rank raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from slidedp.backend.state.staging import pieces_from, pieces_into
from slidedp.errors import SlidedpError

FORMAT = 1
MANIFEST = "manifest.json"
ENGINE_JSON = "engine.json"
HF_DIR = "hf"
STATE_ARRAYS = ("master", "exp_avg", "exp_avg_sq")
_CHUNK_BYTES = 64 << 20
_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"

# safetensors dtype names (https://github.com/huggingface/safetensors, format description)
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(SlidedpError, ValueError):
    """A checkpoint folder is incomplete, altered, or does not fit the engine; the message says which."""


def layer_file(layer_id: int) -> str:
    return f"state/layer-{layer_id:05d}.safetensors"


def layer_piece_file(layer_id: int, host: int, hosts: int) -> str:
    """The file of the runs of a layer that host `host` of `hosts` held."""
    return f"state/layer-{layer_id:05d}.host-{host:03d}-of-{hosts:03d}.safetensors"


def layer_pieces(record: dict) -> list:
    """[[file, [[lo, hi], ...]], ...] of a layer record of engine.json (the whole-layer file by default)."""
    return record.get("pieces") or [[layer_file(record["id"]), [[0, record["numel"]]]]]


# --------------------------------------------------------------------------------------------
# safetensors, streamed from and into existing memory


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _pieces(t: torch.Tensor):
    """The bytes of a contiguous tensor, _CHUNK_BYTES at a time: views of a CPU tensor's memory, a
    device tensor's through the staging buffer (backend/state/staging.py)."""
    if t.device.type == "cpu":
        view = _byte_view(t)
        for lo in range(0, len(view), _CHUNK_BYTES):
            yield view[lo : lo + _CHUNK_BYTES]
        return
    for _, _, piece in pieces_from(t, piece_bytes=_CHUNK_BYTES):
        yield _byte_view(piece)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file straight from the tensors' memory (a device tensor's a piece at a time,
    through a bounded host buffer); fsync it; return its sha256."""
    tensors = {k: (v if v.is_contiguous() else v.detach().contiguous()) for k, v in tensors.items()}
    header: dict = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(blob)), blob):
            f.write(piece)
            digest.update(piece)
        for t in tensors.values():
            for piece in _pieces(t):
                f.write(piece)
                digest.update(piece)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset of the data) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    return header, 8 + n


def _read_tensor_into(f, dst: torch.Tensor, path: Path, name: str) -> None:
    """Fill `dst` from the open file `f` at its position, in pieces (through the staging buffer for a
    device tensor); a file that ends first is refused as truncated."""
    pieces = ((None, None, dst),) if dst.device.type == "cpu" else pieces_into(dst, piece_bytes=_CHUNK_BYTES)
    for _, _, piece in pieces:
        view = _byte_view(piece)
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + _CHUNK_BYTES])
            if not n:
                raise CheckpointError(f"{path}: ends inside tensor {name!r} (truncated)")
            done += n


def read_safetensors_into(path: Path, targets: dict[str, torch.Tensor]) -> None:
    """Read the named tensors of a safetensors file into existing contiguous tensors (same dtype and
    number of elements): a CPU tensor without an intermediate copy, a device tensor a piece at a
    time through a bounded host buffer (backend/state/staging.py)."""
    header, start = read_safetensors_header(path)
    with open(path, "rb") as f:
        for name, dst in targets.items():
            info = header.get(name)
            if info is None:
                raise CheckpointError(f"{path}: has no tensor {name!r}")
            lo, hi = info["data_offsets"]
            if info["dtype"] != _DTYPE_NAMES.get(dst.dtype) or hi - lo != dst.numel() * dst.element_size():
                raise CheckpointError(f"{path}: tensor {name!r} is {info['dtype']} {info['shape']}, expected "
                                      f"{dst.dtype} with {dst.numel()} elements")
            f.seek(start + lo)
            _read_tensor_into(f, dst, path, name)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (small) safetensors file, as new CPU tensors."""
    return load_file(str(path))


# --------------------------------------------------------------------------------------------
# Atomic folders and the manifest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary folder and records their sha256."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, str] = {}  # relative path -> sha256

    def path(self, rel: str) -> Path:
        """Where to write `rel` (its folder is created); call `add(rel)` once it is written."""
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def add(self, rel: str) -> None:
        """Record (hash and fsync) a file written at `path(rel)` by other code."""
        p = self.root / rel
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
        self.files[rel] = _sha256_file(p)

    def tensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        self.files[rel] = write_safetensors(self.path(rel), tensors, metadata)

    def json(self, rel: str, obj) -> None:
        data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
        with open(self.path(rel), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = hashlib.sha256(data).hexdigest()

    def add_folder(self, rel_dir: str) -> None:
        """Record every file under `rel_dir` not recorded yet (files written by `save_pretrained`)."""
        base = self.root / rel_dir
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and rel not in self.files:
                self.add(rel)

    def finish(self) -> None:
        manifest = {
            "format": FORMAT,
            "files": {rel: {"sha256": sha, "bytes": (self.root / rel).stat().st_size}
                      for rel, sha in sorted(self.files.items())},
        }
        self.json(MANIFEST, manifest)
        for d in sorted({(self.root / rel).parent for rel in self.files}, key=lambda p: -len(p.parts)):
            _fsync_dir(d)


@contextlib.contextmanager
def atomic_checkpoint(target: str | os.PathLike):
    """Yield a `CheckpointWriter` on a temporary sibling of `target`; on success the folder
    replaces `target` atomically (an existing `target` is replaced); on error nothing changes."""
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{target.name}{_TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        writer = CheckpointWriter(tmp)
        yield writer
        writer.finish()
        _fsync_dir(tmp)
        if target.exists():
            old = parent / f".{target.name}{_OLD_TAG}{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temps(parent: Path) -> None:
    """Remove temporary folders that an interrupted save left in `parent` (call with no save running)."""
    if parent.is_dir():
        for p in parent.iterdir():
            if p.is_dir() and p.name.startswith(".") and (_TMP_TAG in p.name or _OLD_TAG in p.name):
                shutil.rmtree(p, ignore_errors=True)


def _safe_relative(rel) -> bool:
    """A manifest name that stays inside the checkpoint: relative, no '..', no backslash."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel or rel.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def read_checkpoint_json(folder: Path, name: str, *, fmt, what: str, missing: str) -> dict:
    """A JSON object file of a checkpoint whose "format" must be `fmt`; a CheckpointError names the
    folder and the file otherwise (`missing`: why the file may be absent; `what`: the file's role)."""
    try:
        data = json.loads((Path(folder) / name).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {name}: {missing}") from None
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {folder}: {name} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else None
        raise CheckpointError(f"checkpoint {folder}: {what} format {found!r} is not supported "
                              f"(this slidedp reads format {fmt})")
    return data


def verify_checkpoint(folder: str | os.PathLike, *, required: tuple[str, ...] = ()) -> dict:
    """Check every file of the manifest (presence, size, sha256), that the manifest lists every
    file of the folder and the `required` ones, and that its names stay inside the folder;
    return the manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    manifest = read_checkpoint_json(folder, MANIFEST, fmt=FORMAT, what="checkpoint",
                                    missing="it is not a complete slidedp checkpoint (it may come from an "
                                            "interrupted save)")
    entries = manifest.get("files")
    if not isinstance(entries, dict) or not entries:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} has no 'files' table (altered)")
    for rel, entry in entries.items():
        if not _safe_relative(rel):
            raise CheckpointError(f"checkpoint {folder}: {MANIFEST} names {rel!r}, which is not a path inside "
                                  "the checkpoint (altered)")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or not isinstance(entry.get("bytes"), int) or isinstance(entry.get("bytes"), bool)):
            raise CheckpointError(f"checkpoint {folder}: {MANIFEST} entry of {rel} is not "
                                  "{'sha256': str, 'bytes': int} (altered)")
    for rel in required:
        if rel not in entries:
            raise CheckpointError(f"checkpoint {folder}: {MANIFEST} does not list {rel} (altered, or not a "
                                  "checkpoint of this kind)")
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != MANIFEST and not p.name.startswith(".") and rel not in entries:
            raise CheckpointError(f"checkpoint {folder}: file {rel} is not listed in {MANIFEST} (added or "
                                  "renamed after the checkpoint was written)")
    for rel, entry in entries.items():
        p = folder / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {rel} is missing")
        size = p.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {folder}: file {rel} has {size} bytes, the manifest says "
                                  f"{entry['bytes']} (truncated or altered)")
    names = sorted(entries)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        digests = dict(zip(names, pool.map(lambda rel: _sha256_file(folder / rel), names)))
    for rel in names:
        if digests[rel] != entries[rel]["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: file {rel} does not match its sha256 in the manifest "
                                  "(corrupted or altered)")
    return manifest


# --------------------------------------------------------------------------------------------
# The engine's state


def _layout_record(engine, pieces=None) -> list[dict]:
    aliases = {p.name: list(p.aliases) for layer in engine.graph.layers for p in layer.params}
    records = [
        {"id": layout.layer_id, "name": engine.graph.layers[layout.layer_id].name, "numel": layout.numel,
         "params": [[name, start, numel, list(shape), aliases.get(name, [])]
                    for name, start, numel, shape in layout.param_offsets]}
        for layout in engine.host.layouts
    ]
    for record in records:
        if pieces and record["id"] in pieces:
            record["pieces"] = pieces[record["id"]]
    return records


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return tensors, {
        "python": {"version": version, "state": list(state), "gauss_next": gauss},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }


def _set_rng_state(tensors: dict[str, torch.Tensor], states: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors)) if f"cuda.{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    py = states["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = states["numpy"]
    np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))


def _is_int(v, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)


def check_rng_files(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON states) of a checkpoint's RNG files, every key checked: a `CheckpointError`
    names the file and the key instead of a library's own error when the generators are set."""
    folder = Path(folder)

    def bad(name: str, key: str, what: str, value) -> CheckpointError:
        shown = repr(value) if len(repr(value)) < 60 else f"{type(value).__name__} {repr(value)[:40]}..."
        return CheckpointError(f"checkpoint {folder}: {name} key {key!r} must be {what}, got {shown} (altered)")

    try:
        tensors = read_safetensors(folder / "rng.safetensors")
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {folder}: rng.safetensors cannot be read ({exc})") from None
    for key, t in tensors.items():
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise bad("rng.safetensors", key, "a 1-D uint8 tensor", f"{t.dtype} {list(t.shape)}")
    if "torch" not in tensors:
        raise bad("rng.safetensors", "torch", "present", None)
    try:
        states = json.loads((folder / "rng.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: rng.json is not valid JSON ({exc})") from None
    py = states.get("python") if isinstance(states, dict) else None
    npy = states.get("numpy") if isinstance(states, dict) else None
    if not isinstance(py, dict):
        raise bad("rng.json", "python", "an object", py)
    if not isinstance(npy, dict):
        raise bad("rng.json", "numpy", "an object", npy)
    if not _is_int(py.get("version")):
        raise bad("rng.json", "python.version", "an integer", py.get("version"))
    if not (isinstance(py.get("state"), list) and len(py["state"]) == 625
            and all(_is_int(v, 0, 2**32 - 1) for v in py["state"][:-1]) and _is_int(py["state"][-1], 0, 624)):
        raise bad("rng.json", "python.state", "624 32-bit integers and a position 0..624", py.get("state"))
    if py.get("gauss_next") is not None and not isinstance(py["gauss_next"], (int, float)):
        raise bad("rng.json", "python.gauss_next", "a number or null", py["gauss_next"])
    if npy.get("name") != "MT19937":
        raise bad("rng.json", "numpy.name", "'MT19937'", npy.get("name"))
    if not (isinstance(npy.get("keys"), list) and len(npy["keys"]) == 624
            and all(_is_int(v, 0, 2**32 - 1) for v in npy["keys"])):
        raise bad("rng.json", "numpy.keys", "624 32-bit integers", npy.get("keys"))
    if not _is_int(npy.get("pos"), 0, 624):
        raise bad("rng.json", "numpy.pos", "an integer 0..624", npy.get("pos"))
    if not _is_int(npy.get("has_gauss"), 0, 1):
        raise bad("rng.json", "numpy.has_gauss", "0 or 1", npy.get("has_gauss"))
    if not isinstance(npy.get("cached_gaussian"), (int, float)) or isinstance(npy.get("cached_gaussian"), bool):
        raise bad("rng.json", "numpy.cached_gaussian", "a number", npy.get("cached_gaussian"))
    return tensors, states


def write_engine_state(engine, writer: CheckpointWriter, *, pieces=None) -> None:
    """Master weights, AdamW moments and step, frozen parameters, RNG, plan and model config.
    `pieces`: {layer id: [[file, runs], ...]} of the layers whose files the hosts wrote (several
    hosts: `write_sharded_checkpoint`); the others are written here whole."""
    engine.updates.flush()
    host, pieces = engine.host, pieces or {}
    for layout, arrays in zip(host.layouts, host.layers):
        if layout.layer_id in pieces:
            continue
        if layout.runs is not None:
            raise CheckpointError(f"layer {layout.layer_id} is held in part on this host: several hosts write a "
                                  "checkpoint together (Engine.save_checkpoint)")
        if layout.lean:  # the state lives on the device alone (device_state.py): streamed down
            tensors = engine.runner.device_state.arrays(layout.layer_id)
        else:
            tensors = {k: getattr(arrays, k) for k in STATE_ARRAYS}
        writer.tensors(layer_file(layout.layer_id), {k: tensors[k] for k in STATE_ARRAYS})
    frozen = {name: p.detach() for name, p in engine.model.named_parameters() if not p.requires_grad}
    if frozen:
        writer.tensors("frozen.safetensors", frozen)
    rng_tensors, rng_json = _rng_state()
    writer.tensors("rng.safetensors", rng_tensors)
    writer.json("rng.json", rng_json)
    engine.plan.save(writer.path("plan.json"))
    writer.add("plan.json")
    config = getattr(engine.model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(writer.path(f"{HF_DIR}/config.json"))
        writer.add(f"{HF_DIR}/config.json")
        generation = getattr(engine.model, "generation_config", None)
        if generation is not None and hasattr(generation, "to_json_file"):
            generation.to_json_file(writer.path(f"{HF_DIR}/generation_config.json"))
            writer.add(f"{HF_DIR}/generation_config.json")
    writer.json(ENGINE_JSON, {
        "format": FORMAT,
        "step": host.step,
        "skipped_steps": engine.skipped_steps,
        "precision": engine.precision,
        "optimizer": engine.optimizer.to_dict(),
        "max_grad_norm": engine.max_grad_norm,
        "model_class": engine.graph.model_class,
        "layers": _layout_record(engine, pieces),
        "frozen": sorted(frozen),
    })


def write_host_layers(engine, root: Path, host: int, hosts: int) -> dict[str, str]:
    """This host's layer files (the layers it holds in part) into the folder `root`; {file: sha256}."""
    files = {}
    for layout, arrays in zip(engine.host.layouts, engine.host.layers):
        if layout.runs is None or not layout.runs:
            continue
        rel = layer_piece_file(layout.layer_id, host, hosts)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        files[rel] = write_safetensors(path, {k: getattr(arrays, k) for k in STATE_ARRAYS},
                                       metadata={"runs": json.dumps([list(r) for r in layout.runs])})
    return files


def write_sharded_checkpoint(engine, target: str | os.PathLike, comm, runs_of_host, add=None) -> None:
    """A checkpoint of an engine whose hosts each hold a share of the state (a collective of every
    rank, after `sync_host`): each host's first rank writes its layer files, rank 0 the rest
    (`write_engine_state`, then `add(writer)` if given) and the manifest listing every host's files,
    once every host has finished. `runs_of_host(h)`: {layer id: runs} that host h holds. On any
    host's failure nothing is committed and every rank raises a CheckpointError naming the host."""
    ctx = writer = None
    error = None
    if comm.rank == 0:
        ctx = atomic_checkpoint(target)
        try:
            writer = ctx.__enter__()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error, ctx = f"rank 0 cannot make the checkpoint folder ({exc})", None
    root = comm.share(None if writer is None else str(writer.root))
    files: dict[str, str] = {}
    if root is not None and engine.runner.leader:
        try:
            files = write_host_layers(engine, Path(root), comm.host_index, comm.hosts)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"host {comm.host_index} failed writing its layers ({type(exc).__name__}: {exc})"
    results = comm.all_gather((files, error))
    errors = [e for _, e in results if e]
    if comm.rank == 0 and ctx is not None:
        if errors:
            ctx.__exit__(CheckpointError, CheckpointError(errors[0]), None)  # the temporary folder goes
        else:
            try:
                for host_files, _ in results:
                    writer.files.update(host_files)
                pieces: dict[int, list] = {}
                for h in range(comm.hosts):
                    for layer_id, runs in runs_of_host(h).items():
                        if runs:
                            pieces.setdefault(layer_id, []).append(
                                [layer_piece_file(layer_id, h, comm.hosts), [list(r) for r in runs]])
                write_engine_state(engine, writer, pieces=pieces)
                if add is not None:
                    add(writer)
            except BaseException as exc:
                ctx.__exit__(type(exc), exc, exc.__traceback__)
                errors = [f"rank 0 failed writing the checkpoint ({type(exc).__name__}: {exc})"]
            else:
                try:
                    ctx.__exit__(None, None, None)  # the manifest, then the folder into place
                except Exception as exc:  # noqa: BLE001 - reported to every rank below
                    errors = [f"rank 0 failed committing the checkpoint ({type(exc).__name__}: {exc})"]
    errors = comm.share(errors)
    if errors:
        raise CheckpointError(f"checkpoint {target} not written: {'; '.join(errors)}")


def read_engine_meta(folder: Path) -> dict:
    meta = read_checkpoint_json(folder, ENGINE_JSON, fmt=FORMAT, what="engine state",
                                missing="it holds no engine state")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {folder}: {ENGINE_JSON} key 'step' must be an integer >= 0, got {step!r}")
    skipped = meta.get("skipped_steps", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0:
        raise CheckpointError(f"checkpoint {folder}: {ENGINE_JSON} key 'skipped_steps' must be an integer >= 0, "
                              f"got {skipped!r}")
    layers = meta.get("layers")
    try:
        ok = isinstance(layers, list) and all(
            isinstance(layer["id"], int) and isinstance(layer["numel"], int) and layer["numel"] >= 0
            and all(len(p) == 5 for p in layer["params"]) for layer in layers)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"checkpoint {folder}: {ENGINE_JSON} key 'layers' is not a list of "
                              "{id, numel, params} records (altered)")
    for layer in layers:
        try:
            pieces = layer_pieces(layer)
            good = all(_safe_relative(rel) and all(_is_int(lo) and _is_int(hi, lo, layer["numel"]) for lo, hi in runs)
                       for rel, runs in pieces)
            covered = sorted((lo, hi) for _, runs in pieces for lo, hi in runs if hi > lo)
            ends = [0] + [hi for _, hi in covered]  # each run starts where the one before ends, from 0 to numel
            good = good and [lo for lo, _ in covered] == ends[:-1] and ends[-1] == layer["numel"]
        except (TypeError, ValueError):
            good = False
        if not good:
            raise CheckpointError(f"checkpoint {folder}: {ENGINE_JSON} layer {layer['id']}: 'pieces' must be "
                                  "[file, [[lo, hi], ...]] records inside the checkpoint that cover the layer once "
                                  "(altered)")
    return meta


def _check_layout(engine, meta: dict, folder: Path) -> None:
    mine = _layout_record(engine)
    theirs = meta["layers"]
    if len(mine) != len(theirs):
        raise CheckpointError(f"checkpoint {folder} holds {len(theirs)} layers ({meta.get('model_class')}), "
                              f"this engine's model has {len(mine)} ({engine.graph.model_class})")
    for a, b in zip(mine, theirs):
        pa = [p[:4] for p in a["params"]]
        pb = [p[:4] for p in b["params"]]
        if pa != pb:
            diff = next(((x, y) for x, y in zip(pa, pb) if x != y), (pa[len(pb):][:1], pb[len(pa):][:1]))
            raise CheckpointError(f"checkpoint {folder} does not fit this model: layer {a['id']} ({a['name']}) "
                                  f"differs, first at {diff[1]} in the checkpoint vs {diff[0]} here")


class _PieceReader:
    """Element ranges of a layer's arrays from a checkpoint's pieces (headers read once per file)."""

    def __init__(self, folder: Path):
        self.folder, self._headers = folder, {}

    def _header(self, rel: str) -> tuple[dict, int]:
        if rel not in self._headers:
            self._headers[rel] = read_safetensors_header(self.folder / rel)
        return self._headers[rel]

    def read(self, record: dict, name: str, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the layer's array `name` into `dst` (contiguous, hi - lo elements, on
        any device: a device tensor a piece at a time through a bounded host buffer)."""
        covered = 0
        for rel, runs in layer_pieces(record):
            base = 0
            for a, b in runs:
                x, y = max(a, lo), min(b, hi)
                if x < y:
                    self._read_elements(rel, name, base + x - a, dst[x - lo : y - lo], sum(b - a for a, b in runs))
                    covered += y - x
                base += b - a
        if covered != hi - lo:
            raise CheckpointError(f"checkpoint {self.folder}: layer {record['id']} elements [{lo}, {hi}) are not "
                                  "all in its files (altered)")

    def _read_elements(self, rel: str, name: str, first: int, dst: torch.Tensor, total: int) -> None:
        header, start = self._header(rel)
        path = self.folder / rel
        info = header.get(name)
        if info is None:
            raise CheckpointError(f"{path}: has no tensor {name!r}")
        lo, hi = info["data_offsets"]
        size = dst.element_size()
        if info["dtype"] != _DTYPE_NAMES.get(dst.dtype) or hi - lo != total * size:
            raise CheckpointError(f"{path}: tensor {name!r} is {info['dtype']} {info['shape']}, expected "
                                  f"{dst.dtype} with {total} elements")
        with open(path, "rb") as f:
            f.seek(start + lo + first * size)
            _read_tensor_into(f, dst, path, name)


def check_engine_checkpoint(engine, folder: str | os.PathLike, *, verify: bool = True):
    """(engine.json, RNG states) of a checkpoint that fits the engine, every file verified first
    (`verify`); nothing of the engine changes."""
    folder = Path(folder)
    if verify:
        verify_checkpoint(folder, required=(ENGINE_JSON,))
    meta = read_engine_meta(folder)
    rng = check_rng_files(folder)  # before anything changes
    _check_layout(engine, meta, folder)
    return meta, rng


def read_state_arrays(engine, folder: str | os.PathLike, meta: dict) -> None:
    """The state of every layer from the checkpoint's layer files into the engine's host state, the
    runs this host holds (one host: all; a checkpoint of any number of hosts), or into the device for
    a lean layer; the delivery copy follows the master."""
    folder = Path(folder)
    engine.updates.flush()
    reader = _PieceReader(folder)
    records = {record["id"]: record for record in meta["layers"]}
    for layout, arrays in zip(engine.host.layouts, engine.host.layers):
        record = records[layout.layer_id]
        if layout.lean:  # the state lives on the device alone (device_state.py): streamed up
            for k, dst in engine.runner.device_state.arrays(layout.layer_id).items():
                reader.read(record, k, dst, 0, layout.numel)
            continue
        for lo, hi, here in arrays.held():
            for k in STATE_ARRAYS:
                reader.read(record, k, getattr(arrays, k)[here], lo, hi)
        if arrays.delivery is not None:
            arrays.delivery.copy_(arrays.master)  # bf16, round to nearest even, as the optimizer writes it


def read_engine_state(engine, folder: str | os.PathLike, *, verify: bool = True) -> dict:
    """Load a checkpoint written by `write_engine_state` into the engine; returns engine.json."""
    folder = Path(folder)
    meta, rng = check_engine_checkpoint(engine, folder, verify=verify)
    read_state_arrays(engine, folder, meta)
    apply_engine_meta(engine, folder, meta, rng)
    engine.reload()  # every rank reloads its device copies and takes the step
    return meta


def apply_engine_meta(engine, folder: Path, meta: dict, rng) -> None:
    """Frozen parameters, step, skipped steps and (given `rng`) the generators from a checkpoint."""
    folder = Path(folder)
    if meta.get("frozen"):
        frozen = read_safetensors(folder / "frozen.safetensors")
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if not p.requires_grad and name in frozen:
                    p.copy_(frozen[name])
    engine.host.step = int(meta["step"])
    engine.skipped_steps = int(meta.get("skipped_steps", 0))
    if rng is not None:
        _set_rng_state(*rng)


def read_layer_arrays(folder: str | os.PathLike) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer id, "master" | "exp_avg" | "exp_avg_sq"): whole fp32 tensor} of a checkpoint written
    by any number of hosts (small models: every array in memory at once)."""
    folder = Path(folder)
    reader = _PieceReader(folder)
    out = {}
    for layer in read_engine_meta(folder)["layers"]:
        for name in STATE_ARRAYS:
            out[layer["id"], name] = flat = torch.empty(layer["numel"], dtype=torch.float32)
            reader.read(layer, name, flat, 0, layer["numel"])
    return out


def read_master_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{parameter name: fp32 tensor} from a checkpoint alone (every tied name, frozen parameters too)."""
    folder = Path(folder)
    meta = read_engine_meta(folder)
    out: dict[str, torch.Tensor] = {}
    reader = _PieceReader(folder)
    for layer in meta["layers"]:
        flat = torch.empty(layer["numel"], dtype=torch.float32)
        reader.read(layer, "master", flat, 0, layer["numel"])
        for name, start, numel, shape, aliases in layer["params"]:
            value = flat[start : start + numel].view(shape)
            for n in (name, *aliases):
                out[n] = value
    if meta.get("frozen"):
        out.update(read_safetensors(folder / "frozen.safetensors"))
    return out


# --------------------------------------------------------------------------------------------
# Hugging Face export


EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def save_hf(model, weights: dict[str, torch.Tensor], out: str | os.PathLike, *, dtype: str = "fp32",
            tokenizer=None) -> None:
    """`save_pretrained` of `model` with `weights` (name -> tensor) in place of its own parameters,
    in `dtype` ("bf16" or "fp32": the floating-point weights and the config's `dtype`), with the
    `tokenizer` beside them when given. The files get the usual permissions (0666 less the umask:
    readable by others as any file the user writes), not the 0600 that `save_pretrained` leaves.

    `model` may live on the meta device (a skeleton from `hf_skeleton`). A model loaded from a
    quantized file (GGUF) cannot be saved as is: a skeleton is built from its config without
    `quantization_config`, and the weights are saved through that one.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be 'bf16' or 'fp32', got {dtype!r}")
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise TypeError(f"{type(model).__name__} is not a Hugging Face model (no save_pretrained): "
                        "use engine.state_dict() to get its weights")
    if getattr(model.config, "quantization_config", None) is not None:
        generation = getattr(model, "generation_config", None)
        model = hf_skeleton(model.config)
        if generation is not None:
            model.generation_config = generation
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(names - set(weights))
    if missing:
        raise CheckpointError(f"no weights for {len(missing)} parameter(s) of the model, e.g. {missing[0]}")
    to = EXPORT_DTYPES[dtype]
    state = {n: w.detach().to(to) if w.is_floating_point() else w.detach() for n, w in weights.items() if n in names}
    for name, tensor in model.state_dict().items():  # persistent buffers, saved as the model has them
        state.setdefault(name, tensor)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state, safe_serialization=True)
    config_file = out / "config.json"
    if config_file.is_file():  # the dtype the weights are in (save_pretrained writes the model's own)
        config = json.loads(config_file.read_text())
        config["dtype"] = str(to).removeprefix("torch.")
        config.pop("torch_dtype", None)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    usual_permissions(out)


def usual_permissions(folder: Path) -> None:
    """Every file under `folder` to 0666 less the process's umask (the permissions of a file the
    user creates; 0644 under the common umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(folder).rglob("*"):
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def hf_skeleton(config):
    """A fp32 causal LM built from a config (without `quantization_config`): on the meta device
    (nothing allocated) unless it has persistent buffers, whose values only a real build gives."""
    # transformers only for Hugging Face models: the engine (any nn.Module) imports this module
    from transformers import AutoConfig, AutoModelForCausalLM

    data = config.to_dict()
    data.pop("quantization_config", None)
    data.pop("_name_or_path", None)
    data["dtype"] = "float32"
    clean = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(clean, dtype=torch.float32)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if any(name not in params for name in model.state_dict()):
        model = AutoModelForCausalLM.from_config(clean, dtype=torch.float32)
    return model
