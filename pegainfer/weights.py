"""Read safetensors weights without copying them: parse the header ourselves, ``np.memmap`` the file, hand out
views, upload each tensor to the GPU once.

A safetensors file is::

    [8 bytes: little-endian u64 N][N bytes: JSON header][data]
    header = {"name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
              "__metadata__": {...}}          # offsets are relative to the start of the data section

A model is either one ``model.safetensors`` or shards ``model-0000k-of-0000n.safetensors`` listed by
``model.safetensors.index.json`` (shards without an index are found by globbing ``*.safetensors``).

On the device every weight is bf16 stored as ``uint16`` bits (see ``pegainfer.kernels.primitives``).  BF16
tensors are uploaded straight from the memory map; F16 and F32 tensors are rounded to bf16 (nearest-even) first.
Loading a 16 GB folder is then page-cache reads plus one host→device copy per tensor: seconds, not minutes.
"""
from __future__ import annotations

import difflib
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from pegainfer.errors import OutOfMemoryError, WeightError
from pegainfer.jsonfile import read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000

# dtypes pegainfer can turn into bf16, as little-endian numpy dtypes (BF16 stays raw uint16 bits)
_NUMPY_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
# every safetensors dtype's size, to validate the header even for tensors we never read
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

# where the decoder's tensors live, most specific first
_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")


class TensorInfo(NamedTuple):
    """One tensor's place on disk: absolute byte range ``[begin, end)`` in ``file``."""
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ------------------------------------------------------------------------------------------------ files on disk
def _corrupt(path: Path, detail: str) -> WeightError:
    return WeightError(f"{path.name} in {path.parent} is truncated or corrupt ({detail}): re-download it")


def find_safetensors(folder) -> tuple[list[Path], Path | None]:
    """The weight files of a model folder and the index that lists them (``None`` when there is none)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightError(f"{INDEX_NAME} in {folder} has no 'weight_map': re-download it")
        names = sorted(set(map(str, weight_map.values())))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WeightError(f"{INDEX_NAME} in {folder} lists {', '.join(missing)}, which "
                              f"{'is' if len(missing) == 1 else 'are'} missing: the download is incomplete")
        return [folder / n for n in names], index
    if (folder / SINGLE_NAME).is_file():
        return [folder / SINGLE_NAME], None
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if files:
        return files, None
    other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = (f" (found {', '.join(other[:3])}: pegainfer reads only safetensors; convert with transformers' "
            f"save_pretrained(..., safe_serialization=True))") if other else ""
    raise WeightError(f"no *.safetensors weights in {folder}{hint}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and validate every entry against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"the file is only {size} bytes")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header length {n} does not fit in a {size}-byte file")
            raw = fh.read(n)
    except OSError as e:
        raise WeightError(f"cannot read {path}: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
                  and type(b) is int and type(end) is int and 0 <= b <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(path, f"bad header entry for {name!r}: {e!r}")
        if end > data_len:
            raise _corrupt(path, f"tensor {name!r} ends at data byte {end} but the file has only {data_len}")
        item = _ITEMSIZE.get(dtype)
        if item is not None and end - b != math.prod(shape) * item:
            raise _corrupt(path, f"tensor {name!r} is {end - b} bytes, but {dtype} {list(shape)} needs "
                                 f"{math.prod(shape) * item}")
        out[name] = TensorInfo(path, dtype, shape, data_start + b, data_start + end)
    return out


def list_tensor_names(folder) -> list[str]:
    """All tensor names of a model folder, cheaply (the index's ``weight_map``, or the files' headers)."""
    files, index = find_safetensors(folder)
    if index is not None:
        return list(read_json(index)["weight_map"])
    return [name for f in files for name in read_header(f)]


def prefix_for(names) -> str:
    """Where the language model's tensors live: ``"model.language_model."`` (Qwen3.5 multimodal checkpoint),
    ``"model."`` (``*ForCausalLM``), ... — the prefix in front of ``embed_tokens.weight``."""
    names = set(names)
    for prefix in _PREFIXES:
        if prefix + "embed_tokens.weight" in names:
            return prefix
    raise WeightError("cannot find the language model's embedding: expected a tensor named "
                      "model.embed_tokens.weight or model.language_model.embed_tokens.weight")


# ------------------------------------------------------------------------------------------------- progress
class Progress:
    """Weight-loading progress on stderr: one self-overwriting line on a terminal, a summary when ``verbose``.

    ``update(nbytes)`` after each tensor; ``finish()`` once at the end."""

    def __init__(self, total_bytes: int | None = None, total_tensors: int | None = None,
                 label: str = "loading weights", verbose: bool = False, stream=None):
        self.total_bytes, self.total_tensors, self.label, self.verbose = total_bytes, total_tensors, label, verbose
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bytes = self.tensors = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._finished = False

    def _rate(self) -> float:
        return self.bytes / 1e6 / max(time.perf_counter() - self.start, 1e-9)

    def line(self) -> str:
        tensors = f"{self.tensors}/{self.total_tensors}" if self.total_tensors else f"{self.tensors}"
        gb = f"{self.bytes / 1e9:.2f}"
        if self.total_bytes:
            gb += f"/{self.total_bytes / 1e9:.2f} GB ({100 * self.bytes / self.total_bytes:.0f}%)"
        else:
            gb += " GB"
        return f"{self.label}: {tensors} tensors, {gb}, {self._rate():.0f} MB/s"

    def update(self, nbytes: int, tensors: int = 1) -> None:
        self.bytes += int(nbytes)
        self.tensors += tensors
        now = time.perf_counter()
        if self.tty and now - self._last_draw > 0.1:
            self._last_draw = now
            self.stream.write("\r" + self.line() + "\033[K")
            self.stream.flush()

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K\n")
        if self.verbose:
            secs = time.perf_counter() - self.start
            self.stream.write(f"{self.label}: {self.tensors} tensors, {self.bytes / 1e9:.2f} GB in {secs:.1f} s "
                              f"({self._rate():.0f} MB/s)\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------ the reader
class WeightReader:
    """All tensors of a model folder, memory-mapped.

    >>> r = WeightReader("/models/Qwen3-4B")
    >>> w = r.upload(r.prefix + "layers.0.mlp.down_proj.weight", (2560, 9728))     # device uint16 (bf16 bits)
    >>> r.upload(r.prefix + "layers.0.self_attn.k_proj.weight", (1024, 2560), dest=qkv[4096:5120])  # fused
    """

    def __init__(self, folder, progress: Progress | None = None):
        self.folder = Path(folder)
        self.files, self.index = find_safetensors(self.folder)
        self.progress = progress
        self._tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            self._tensors.update(read_header(f))
        self._maps: dict[Path, np.memmap] = {}

    # ---- queries
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise self._missing(name) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string: ``"BF16"``, ``"F16"``, ``"F32"``, ..."""
        return self.info(name).dtype

    def bf16_nbytes(self, names: Sequence[str]) -> int:
        """Bytes these tensors take on the device (bf16), e.g. for ``Progress(total_bytes=...)``."""
        return sum(2 * self.info(n).numel for n in names)

    @property
    def prefix(self) -> str:
        """The language model's prefix: ``"model."`` or ``"model.language_model."`` (see ``prefix_for``)."""
        return prefix_for(self._tensors)

    def _files_desc(self) -> str:
        if len(self.files) == 1:
            return f"{self.files[0].name} in {self.folder}"
        return f"the {len(self.files)} files {self.files[0].name} … {self.files[-1].name} in {self.folder}"

    def _missing(self, name: str) -> WeightError:
        close = difflib.get_close_matches(name, self._tensors, n=1, cutoff=0.8)
        hint = f" (closest: {close[0]!r})" if close else ""
        return WeightError(f"tensor {name!r} not found in {self._files_desc()}{hint}: the checkpoint is incomplete "
                           f"or is not the model config.json describes")

    # ---- host views
    def _map(self, path: Path) -> np.memmap:
        m = self._maps.get(path)
        if m is None:
            try:
                m = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise WeightError(f"cannot memory-map {path}: {e}") from None
        return m

    def host_raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (BF16 as uint16 bits): a read-only view of the memory map."""
        t = self.info(name)
        dt = _NUMPY_DTYPES.get(t.dtype)
        if dt is None:
            raise WeightError(f"tensor {name!r} in {t.file.name} has dtype {t.dtype}; pegainfer loads BF16, F16 and "
                              f"F32 weights (quantized checkpoints are not supported)")
        return self._map(t.file)[t.begin:t.end].view(dt).reshape(t.shape).view(np.ndarray)

    def _check_shape(self, name: str, expected_shape) -> None:
        if expected_shape is None:
            return
        t = self.info(name)
        expected = tuple(int(d) for d in expected_shape)
        if t.shape != expected:
            raise WeightError(f"tensor {name!r} in {t.file.name} has shape {list(t.shape)}, expected "
                              f"{list(expected)}: the weights do not match config.json")

    def host_bf16(self, name: str, expected_shape=None) -> np.ndarray:
        """bf16 bits (``uint16``) of a tensor whose shape must equal ``expected_shape`` (``None``: any shape).
        A zero-copy memory-map view when stored as BF16; F16/F32 are rounded to nearest-even into a new array."""
        self._check_shape(name, expected_shape)
        host = self.host_raw(name)
        if host.dtype == np.uint16:
            return host
        from pegainfer.kernels.primitives import to_bf16_bits

        return to_bf16_bits(host)

    # ---- device
    def upload(self, name: str, expected_shape=None, dest=None):
        """Copy a tensor to the GPU as bf16 bits: a new device array, or into ``dest`` (a contiguous device
        array or slice of the tensor's shape, e.g. the k rows of a fused qkv weight).  Returns the device array."""
        host = self.host_bf16(name, expected_shape)
        from numba import cuda

        if dest is None:
            dev = cuda.to_device(host)
        else:
            if tuple(dest.shape) != host.shape or np.dtype(dest.dtype) != np.uint16:
                raise ValueError(f"upload of {name!r}: destination is {np.dtype(dest.dtype)} {tuple(dest.shape)}, "
                                 f"tensor is uint16 {host.shape}")
            dest.copy_to_device(host)
            dev = dest
        if self.progress is not None:
            self.progress.update(host.nbytes)
        return dev

    def close(self) -> None:
        """Drop the memory maps (views handed out keep their file mapped until they are freed)."""
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.finish()
        self.close()


# ------------------------------------------------------------------------------------------------ GPU memory
def check_gpu_memory(needed_bytes: int, what: str, free_bytes: int | None = None) -> None:
    """Raise ``OutOfMemoryError`` when ``needed_bytes`` for ``what`` exceed the GPU's free memory.

    ``free_bytes`` overrides the query (tests); in the simulator, without one, there is nothing to check."""
    if free_bytes is None:
        import pegainfer

        if pegainfer.SIMULATOR:
            return
        from numba import cuda

        free_bytes = cuda.current_context().get_memory_info()[0]
    if needed_bytes > free_bytes:
        gib = 2 ** 30
        raise OutOfMemoryError(f"needs {needed_bytes / gib:.2f} GiB for {what}, only {free_bytes / gib:.2f} GiB free "
                               f"on the GPU: lower --max-model-len or use a larger GPU")
