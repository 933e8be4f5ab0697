"""Reading slices of Hugging Face tensors, and putting full tensors back together.

A parameter of our model is a list of :class:`Part` s, concatenated along dim 0: a rectangle of
one Hugging Face tensor (rows and columns in OUR orientation, ``transpose`` for GPT-2's Conv1D),
or zero rows (vocabulary padding). The same parts serve three uses:

* load: each rank reads its parts from a :class:`TensorSource`; from a checkpoint folder that is
  ``safetensors.safe_open(...).get_slice(name)[rows, cols]``, so a rank reads only its TP shard
  of its pipeline stage's layers, never the full state dict (``safe_open`` maps the file; only
  the sliced bytes are read). Why not DCP's ``HuggingFaceStorageReader``: it loads by our
  parameter names with DCP's resharding planner, which cannot express a fused q/k/v or gate/up
  built from several HF tensors, nor GPT-2's transposes; slicing with safetensors can.
* export: every TP rank's shard is gathered and each piece is written back into the full tensor
  at its part's rectangle (``assemble``).
* initialisation: :class:`RandomInit` is a source that makes each full tensor from a seed and
  its name, so a model initialised at TP2×PP2 equals the one initialised at TP1×PP1.

A MoE layer's stacked experts, (E/ep, in, out) (``p.hf_view == "experts"``), are described by the
parts of their (E/ep · out, in) view (:func:`experts_view`): expert by expert, the TP slice of each
HF tensor of that expert, so a rank reads only its experts' slices. A ``transformers`` module holds
its experts fused (``experts.gate_up_proj``): :func:`open_source` splits them into the checkpoint
names first (:func:`unfuse_experts`), as transformers' own save does.
"""

from __future__ import annotations

import abc
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from tpkernels.models.hf_names import MODULE_MOE_NAMES, MOE_NAMES, OPTIONAL_PREFIXES


@dataclass(frozen=True)
class Part:
    """Rows [r0, r1) × cols [c0, c1) of HF tensor ``name`` in our (out, in) orientation (None: all);
    ``transpose``: the tensor is stored (in, out). ``name=None``: ``zero_shape`` zeros (padding)."""

    name: str | None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    transpose: bool = False
    zero_shape: tuple[int, ...] | None = None


def _sl(r):
    return slice(None) if r is None else slice(*r)


class TensorSource(abc.ABC):
    """Full Hugging Face tensors by name, read a rectangle at a time (subclasses: where they live)."""

    @abc.abstractmethod
    def names(self) -> set[str]:
        """Every tensor name the source holds."""

    @abc.abstractmethod
    def _read(self, name: str, index: tuple) -> torch.Tensor:
        """``tensor[index]`` of tensor ``name`` as stored (index: a tuple of slices)."""

    def info(self, name: str) -> tuple[tuple[int, ...], str] | None:
        """(full shape as stored, dtype name: 'float32', 'int32', 'bool'...) of tensor ``name`` (resolved),
        or None where the source makes its tensors itself and cannot be wrong."""
        return None

    def check(self, shapes: dict[str, tuple[int, ...]], transposed: set[str] = frozenset()) -> None:
        """Before any slice is read: every tensor of ``shapes`` (HF name -> full shape in our (out, in)
        orientation; ``transposed``: the names stored (in, out)) is present, of that full shape and of
        a floating-point dtype. A slice of a larger tensor, or an integer tensor cast, would load
        wrong weights without a word."""
        missing, wrong = [], []
        for name, want in sorted(shapes.items()):
            try:
                found = self.resolve(name)
            except KeyError:
                missing.append(name)
                continue
            got = self.info(found)
            if got is None:
                continue
            shape, dtype = got
            stored = tuple(reversed(want)) if name in transposed and len(want) == 2 else tuple(want)
            if tuple(shape) != stored:
                wrong.append(f"{found}: shape {tuple(shape)}, the model's config needs {stored}")
            elif dtype not in FLOAT_DTYPES:
                wrong.append(f"{found}: dtype {dtype}, weights must be floating point (one of "
                             f"{', '.join(sorted(FLOAT_DTYPES))})")
        if missing:
            more = f" (and {len(missing) - 6} more)" if len(missing) > 6 else ""
            raise ValueError(f"{self.where()} lacks tensor(s) {missing[:6]}{more} that the model's config needs")
        if wrong:
            more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
            raise ValueError(f"{self.where()} does not match the model's config: {'; '.join(wrong[:4])}{more}")

    def where(self) -> str:
        return "the state dict"

    def resolve(self, name: str) -> str:
        names = self.names()
        if name in names:
            return name
        for p in OPTIONAL_PREFIXES:
            if name.startswith(p) and name[len(p):] in names:
                return name[len(p):]
        raise KeyError(f"the checkpoint has no tensor {name!r}")

    def read(self, part: Part, dtype: torch.dtype | None = None) -> torch.Tensor:
        if part.name is None:
            return torch.zeros(part.zero_shape, dtype=dtype or torch.float32)
        name = self.resolve(part.name)
        if part.transpose:  # stored (in, out): our rows are its columns
            t = self._read(name, (_sl(part.cols), _sl(part.rows))).t()
        elif part.cols is not None:
            t = self._read(name, (_sl(part.rows), _sl(part.cols)))
        else:
            t = self._read(name, (_sl(part.rows),))
        return t.to(dtype) if dtype is not None else t


class StateDictSource(TensorSource):
    """An in-memory ``state_dict`` (e.g. of a ``transformers`` model)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.sd = state_dict

    def names(self) -> set[str]:
        return set(self.sd)

    def _read(self, name, index):
        return self.sd[name].detach()[index].cpu()

    def info(self, name):
        t = self.sd[name]
        return tuple(t.shape), str(t.dtype).removeprefix("torch.")


class SafetensorsSource(TensorSource):
    """A checkpoint folder: ``model.safetensors``, or shards listed in ``model.safetensors.index.json``.
    Each file's header is read when the source opens (a truncated or foreign file is refused here,
    naming it); tensors are read a slice at a time."""

    def __init__(self, folder: str | Path):
        from safetensors import SafetensorError, safe_open  # noqa: PLC0415

        folder = self.folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (folder / f).is_file()]
            if absent:
                raise FileNotFoundError(f"{str(index)!r} lists shard(s) {absent} that are not in {str(folder)!r}")
        else:
            if not folder.is_dir():
                raise FileNotFoundError(f"Hugging Face checkpoint folder {str(folder)!r} does not exist")
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{str(folder)!r} holds no *.safetensors file (and no "
                                        "model.safetensors.index.json)")
            weight_map = None
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(folder / f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{str(folder / f)!r} is not a readable safetensors file (truncated or damaged?): "
                                 f"{e}") from None
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        else:
            for f, h in self._handles.items():
                listed = {k for k, v in weight_map.items() if v == f}
                absent = sorted(listed - set(h.keys()))
                if absent:
                    raise ValueError(f"{str(index)!r} places tensor(s) {absent[:4]} in {f!r}, which does not hold "
                                     "them")
        self._where = weight_map
        self.bytes_read = 0

    def names(self) -> set[str]:
        return set(self._where)

    def where(self) -> str:
        return f"Hugging Face checkpoint {str(self.folder)!r}"

    def info(self, name):
        sl = self._handles[self._where[name]].get_slice(name)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype())

    def _read(self, name, index):
        t = self._handles[self._where[name]].get_slice(name)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index, checked: a mapping of tensor names to file names."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"shard index {str(index)!r} is unreadable: {type(e).__name__}: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise ValueError(f"shard index {str(index)!r} must hold a 'weight_map' mapping each tensor name to its "
                         f"file name, got {type(wm).__name__}")
    return wm


FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"})
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class RandomInit(TensorSource):
    """Seeded full tensors, the same at every layout: normal(0, std) for weights (GPT-2's output
    projections std / sqrt(2·layers), as transformers initialises them), ones for norm weights, zeros
    for biases. ``shapes``: HF name → full shape (our orientation)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, std: float, scaled: set[str], num_layers: int):
        self.shapes, self.seed, self.std, self.scaled, self.num_layers = shapes, seed, std, scaled, num_layers
        self._cache: dict[str, torch.Tensor] = {}

    def names(self) -> set[str]:
        return set(self.shapes)

    def _full(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            shape = self.shapes[name]
            if name.endswith(".bias"):
                t = torch.zeros(shape)
            elif len(shape) == 1:
                t = torch.ones(shape)
            else:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)
                std = self.std / math.sqrt(2 * self.num_layers) if name in self.scaled else self.std
                t = torch.randn(shape, generator=g) * std
            self._cache = {name: t}  # parts of one tensor are read one after another: keep one
        return self._cache[name]

    def _read(self, name, index):
        return self._full(name)[index]

    def read(self, part: Part, dtype=None) -> torch.Tensor:
        if part.name is None:
            return torch.zeros(part.zero_shape, dtype=dtype or torch.float32)
        # RandomInit shapes are in our orientation: no transpose
        t = self._read(part.name, (_sl(part.rows), _sl(part.cols)) if part.cols is not None else (_sl(part.rows),))
        return t.to(dtype) if dtype is not None else t.clone()


def experts_view(t: torch.Tensor) -> torch.Tensor:
    """Stacked experts (E, in, out) as their HF parts concatenate: (E · out, in) (each expert's (out, in))."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def from_experts_view(v: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of :func:`experts_view`: (E · out, in) -> (E, in, out) (a view)."""
    e, i, o = shape
    return v.reshape(e, o, i).transpose(1, 2)


def unfuse_experts(sd: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A ``transformers`` MoE module's state dict under its checkpoint names: the fused ``gate_up_proj``
    (E, 2F, H) and ``down_proj`` (E, H, F) split into each expert's gate / up / down (views), the router
    renamed where the files name it otherwise (Mixtral's ``block_sparse_moe``)."""
    import re  # noqa: PLC0415

    names = MOE_NAMES[model_type]
    out = {}
    pattern = {role: re.compile("^" + tpl.replace(".", r"\.").replace("{i}", r"(\d+)") + "$")
               for role, tpl in MODULE_MOE_NAMES.items()}
    for key, t in sd.items():
        for role, rx in pattern.items():
            m = rx.match(key) or rx.match("model." + key)
            if m is None:
                continue
            i = int(m.group(1))
            if role == "router":
                out[names["router"].format(i=i) + ".weight"] = t
            elif role == "gate_up":
                f = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[names["expert_gate"].format(i=i, e=e) + ".weight"] = t[e, :f]
                    out[names["expert_up"].format(i=i, e=e) + ".weight"] = t[e, f:]
            else:
                for e in range(t.shape[0]):
                    out[names["expert_down"].format(i=i, e=e) + ".weight"] = t[e]
            break
        else:
            out[key] = t
    return out


def open_source(obj) -> TensorSource:
    """A TensorSource for a checkpoint folder, a state dict or a ``torch.nn.Module``."""
    if isinstance(obj, TensorSource):
        return obj
    if isinstance(obj, torch.nn.Module):
        kind = getattr(getattr(obj, "config", None), "model_type", None)
        sd = obj.state_dict()
        return StateDictSource(unfuse_experts(sd, kind) if kind in MOE_NAMES else sd)
    if isinstance(obj, dict):
        return StateDictSource(obj)
    return SafetensorsSource(obj)


def assemble(pieces: list[tuple[Part, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full HF tensors from (part, piece) pairs (pieces in our orientation). Parts may overlap (KV heads
    replicated over TP ranks hold equal copies)."""
    extent: dict[str, list] = {}
    for part, piece in pieces:
        if part.name is None:
            continue
        r1 = part.rows[1] if part.rows else piece.shape[0]
        c1 = (part.cols[1] if part.cols else piece.shape[1]) if piece.dim() == 2 else None
        e = extent.setdefault(part.name, [0, 0, piece.dtype, part.transpose, piece.dim()])
        e[0], e[1] = max(e[0], r1), max(e[1], c1 or 0)
    full = {}
    for name, (rows, cols, dtype, transpose, dims) in extent.items():
        full[name] = torch.zeros((rows, cols) if dims == 2 else (rows,), dtype=dtype)
    for part, piece in pieces:
        if part.name is None:
            continue
        t = full[part.name]
        if piece.dim() == 2:
            t[_sl(part.rows), _sl(part.cols)] = piece
        else:
            t[_sl(part.rows)] = piece
    for name, (_, _, _, transpose, dims) in extent.items():
        if transpose and dims == 2:
            full[name] = full[name].t().contiguous()
    return full


__all__ = ["Part", "RandomInit", "SafetensorsSource", "StateDictSource", "TensorSource", "assemble", "experts_view",
           "from_experts_view", "open_source", "unfuse_experts"]
