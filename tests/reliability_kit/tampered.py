"""Tampered models: variants of a GGUF file, each loaded and decoded through the public API
(a projector's, a LoRA adapter's, a control vector's or an importance matrix's variants, when
the setup names the base model, used with it: a projector given an image or a sound, an adapter
or a control vector applied to a completion, an importance matrix given to ``quantize()`` of
it).

The header (magic, counts, metadata, tensor infos) is parsed into its parts, and each variant
changes one thing: a truncation; the version or a count; each metadata value set to 0, 1, its
type's largest value, a negative one, NaN or infinity, another type, or removed; string and
array lengths pointing past the end of the file; array element types and lengths; tensor names,
dimension counts, dimensions, types and offsets; the alignment; a few random bytes; and a few
values in the tensor data (NaN weights). A variant is described by a small JSON spec, so the
parent lists them and each child builds the bytes itself.

No copy of a large model per variant: each child keeps one work file per worker slot, the
original with a padding key (``llamacrab.reliability.pad``) at the end of its metadata. A
variant's header is re-encoded with the padding resized so that the header keeps its exact
length, and written over the work file's header; the tensor data is never rewritten (data
patches and truncations are undone after their case).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
INTEGER_RANGE = {U8: (0, 2**8 - 1), I8: (-(2**7), 2**7 - 1), U16: (0, 2**16 - 1),
                 I16: (-(2**15), 2**15 - 1), U32: (0, 2**32 - 1), I32: (-(2**31), 2**31 - 1),
                 U64: (0, 2**64 - 1), I64: (-(2**63), 2**63 - 1)}  # fmt: skip
PAD_KEY = b"llamacrab.reliability.pad"
PAD_BYTES = 256 * 1024
ARCHITECTURES = ("llama", "gemma3", "bert", "clip", "t5", "mamba", "rwkv6", "qwen2vl",
                 "deepseek2", "gemma3n", "nomic-bert", "", "unknown-arch")  # fmt: skip
TOKENIZERS = ("llama", "gpt2", "bert", "t5", "rwkv", "none", "no_vocab", "test", "plamo2", "x")


def encode_string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def encode_value(vtype: int, value: Any) -> bytes:
    """The bytes of a value of GGUF type ``vtype`` (an array value is (element type, list))."""
    if vtype == STRING:
        return encode_string(value if isinstance(value, bytes) else str(value).encode())
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(
            encode_value(etype, item) for item in items
        )
    return struct.pack(SCALAR[vtype], value)


@dataclass
class Header:
    """A GGUF header in parts: each metadata entry keeps its value's bytes as read."""

    version: int
    kvs: list[tuple[bytes, int, bytes]]  # key, type, value bytes
    tensors: list[tuple[bytes, list[int], int, int]]  # name, dims, type, offset
    data_offset: int = 0  # where the tensor data starts in the original file
    alignment: int = 32
    fields: dict[str, int] = field(default_factory=dict)  # byte offsets, filled by encode

    def value(self, key: bytes) -> tuple[int, bytes] | None:
        for name, vtype, raw in self.kvs:
            if name == key:
                return vtype, raw
        return None

    def encode(self, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
        """The header bytes (no padding to the alignment); records in ``fields`` the offsets
        of its length and type fields, for raw edits."""
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version, len(self.tensors) if n_tensors is None
                           else n_tensors, len(self.kvs) if n_kv is None else n_kv)  # fmt: skip
        self.fields = {}
        for i, (key, vtype, raw) in enumerate(self.kvs):
            self.fields[f"kv{i}.key_len"] = len(out)
            out += encode_string(key)
            self.fields[f"kv{i}.type"] = len(out)
            out += struct.pack("<I", vtype)
            self.fields[f"kv{i}.value"] = len(out)
            out += raw
        for i, (name, dims, ttype, offset) in enumerate(self.tensors):
            self.fields[f"t{i}.name_len"] = len(out)
            out += encode_string(name)
            self.fields[f"t{i}.n_dims"] = len(out)
            out += struct.pack("<I", len(dims))
            self.fields[f"t{i}.dims"] = len(out)
            out += b"".join(struct.pack("<Q", d % 2**64) for d in dims)
            self.fields[f"t{i}.type"] = len(out)
            out += struct.pack("<IQ", ttype, offset % 2**64)
        return bytes(out)


def _skip_value(data: bytes, at: int, vtype: int) -> int:
    if vtype == STRING:
        (length,) = struct.unpack_from("<Q", data, at)
        return at + 8 + length
    if vtype == ARRAY:
        etype, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if etype == STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", data, at)
                at += 8 + length
            return at
        return at + count * struct.calcsize(SCALAR[etype])
    return at + struct.calcsize(SCALAR[vtype])


def parse(path: Path) -> Header:
    with open(path, "rb") as file:
        data = file.read(64 * 1024 * 1024)  # every header we tamper with fits
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF", path
    at = 24
    kvs = []
    alignment = 32
    for _ in range(n_kv):
        (length,) = struct.unpack_from("<Q", data, at)
        key = data[at + 8 : at + 8 + length]
        at += 8 + length
        (vtype,) = struct.unpack_from("<I", data, at)
        at += 4
        end = _skip_value(data, at, vtype)
        kvs.append((key, vtype, data[at:end]))
        if key == b"general.alignment":
            (alignment,) = struct.unpack_from("<I", data, at)
        at = end
    tensors = []
    for _ in range(n_tensors):
        (length,) = struct.unpack_from("<Q", data, at)
        name = data[at + 8 : at + 8 + length]
        at += 8 + length
        (n_dims,) = struct.unpack_from("<I", data, at)
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, at + 4))
        at += 4 + 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", data, at)
        at += 12
        tensors.append((name, dims, ttype, offset))
    data_offset = -(-at // alignment) * alignment
    return Header(version, kvs, tensors, data_offset, alignment)


def padded(header: Header, pad: int) -> Header:
    """``header`` with the padding key of ``pad`` bytes at the end of its metadata."""
    kvs = [kv for kv in header.kvs if kv[0] != PAD_KEY]
    kvs.append((PAD_KEY, STRING, encode_string(b" " * pad)))
    return Header(header.version, kvs, list(header.tensors), header.data_offset,
                  header.alignment)  # fmt: skip


# -- the variants -------------------------------------------------------------------------------


def variants(header: Header, file_size: int, seed: int, *, n_random: int = 40,
             tensor_sample: int = 12) -> list[dict[str, Any]]:  # fmt: skip
    """Every variant spec of a file with this header (deterministic for a seed)."""
    rng = random.Random(seed)
    specs: list[dict[str, Any]] = []

    def add(kind: str, **spec: Any) -> None:
        specs.append({"kind": kind, **spec})

    # Truncations: inside the fixed header, each part of the metadata, the tensor infos and
    # the data (the data ones last: they rewrite the most).
    cuts = {0, 1, 4, 8, 12, 20, 23, 24, 25}
    probe = padded(header, PAD_BYTES)
    probe.encode()
    for name, offset in probe.fields.items():
        if name.endswith((".key_len", ".name_len", ".value", ".dims")):
            cuts.add(offset + rng.choice((0, 1, 4, 7)))
    for cut in sorted(cuts)[:: max(1, len(cuts) // 60)]:
        add("truncate", at=cut)
    add("truncate_data", keep=0)
    add("truncate_data", keep=1)
    add("truncate_data", keep=-1)  # one byte short of the end
    # Magic, version, counts
    for magic in (b"GGUX", b"FUGG", b"\0\0\0\0"):
        add("raw", at=0, data=magic.hex())
    for version in (0, 1, 2, 4, 2**32 - 1):
        add("raw", at=4, data=struct.pack("<I", version).hex())
    real_kv, real_tensors = len(header.kvs) + 1, len(header.tensors)  # + the padding key
    for count in (0, real_tensors - 1, real_tensors + 1, 2**31, 2**63, 2**64 - 1):
        add("raw", at=8, data=struct.pack("<Q", count % 2**64).hex(), what="n_tensors")
    for count in (0, real_kv - 1, real_kv + 1, 2**31, 2**63, 2**64 - 1):
        add("raw", at=16, data=struct.pack("<Q", count % 2**64).hex(), what="n_kv")
    # Every metadata value
    for index, (key, vtype, raw) in enumerate(header.kvs):
        for value_spec in _value_mutations(key, vtype, raw):
            add("kv", index=index, **value_spec)
        add("kv_remove", index=index)
        add("kv_rename", index=index, to="")  # an empty key
        add("kv_rename", index=index, to=header.kvs[(index + 1) % len(header.kvs)][0].decode())
        add("field", name=f"kv{index}.key_len", value=2**64 - 1)
        add("field", name=f"kv{index}.type", value=rng.choice((13, 255, 2**31)))
        if vtype in (STRING, ARRAY):  # a length past the end of the file
            add("field", name=f"kv{index}.value", value=file_size, width=8,
                skip=4 if vtype == ARRAY else 0)  # fmt: skip
            add("field", name=f"kv{index}.value", value=2**64 - 1, width=8,
                skip=4 if vtype == ARRAY else 0)  # fmt: skip
        if vtype == ARRAY:  # another element type
            add("field", name=f"kv{index}.value", value=rng.choice((U8, F64, STRING, ARRAY, 99)),
                width=4)  # fmt: skip
    # Alignment
    for alignment in (0, 1, 3, 8, 64, 2**31):
        add("kv_add", key="general.alignment", vtype=U32, value=alignment)
    add("kv_add", key="general.alignment", vtype=STRING, value="32")
    # Tensor infos: a sample of tensors (always the first and the last)
    chosen = sorted({0, len(header.tensors) - 1}
                    | set(rng.sample(range(len(header.tensors)),
                                     min(tensor_sample, len(header.tensors)))))  # fmt: skip
    for t in chosen:
        name, dims, ttype, offset = header.tensors[t]
        other = header.tensors[(t + 1) % len(header.tensors)]
        for new_name in ("", other[0].decode(), "blk.999.attn_q.weight", "x" * 80,
                         name.decode() + "\0x"):  # fmt: skip
            add("tensor", index=t, name=new_name)
        for new_dims in ([], [*dims, 1], [*dims, 1, 1, 1], [0] * len(dims), dims[::-1],
                         [d * 2 for d in dims], [2**40, *dims[1:]], [2**63, *dims[1:]],
                         [2**64 - 1, *dims[1:]], [max(1, dims[0] - 1), *dims[1:]]):  # fmt: skip
            add("tensor", index=t, dims=new_dims)
        add("field", name=f"t{t}.n_dims", value=rng.choice((5, 255, 2**31)), width=4)
        for new_type in sorted({0, 1, 2, 8, 12, 14, 30, 39, 40, 41, 255, (ttype + 1) % 40}):
            add("tensor", index=t, type=new_type)
        for new_offset in (0, 1, offset + 1, offset + 32, file_size, 2**40, 2**63, 2**64 - 32,
                           other[3]):  # fmt: skip
            add("tensor", index=t, offset=new_offset)
        add("tensor_remove", index=t)
        add("tensor_duplicate", index=t)
    # Tensor data: NaN and infinite weights in a small tensor (the norms: f32)
    for t, (name, dims, ttype, _) in enumerate(header.tensors):
        if ttype == 0 and len(dims) == 1 and b"norm" in name:
            for value in (math.nan, math.inf, 0.0):
                add("data", index=t, value=value)
            break
    # Random bytes over the header
    end = probe.fields.get(f"t{len(header.tensors) - 1}.type", 64) + 12
    for _ in range(n_random):
        positions = [rng.randrange(24, end) for _ in range(rng.choice((1, 2, 4, 8)))]
        add("bytes", edits=[[p, rng.choice((0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)))]
                            for p in positions])  # fmt: skip
    # Numbers in tensor names made huge (a layer index: blk.N, direction.N); last, so that
    # the ids of the variants above stay what they were before these were added
    for t in chosen:
        name = header.tensors[t][0].decode(errors="replace")
        for number in (513, 2**31, 2**64):
            huge = re.sub(r"\d+", str(number), name)
            if huge != name:
                add("tensor", index=t, name=huge)
    return specs


def _value_mutations(key: bytes, vtype: int, raw: bytes) -> list[dict[str, Any]]:
    """New values (``vtype`` and JSON ``value``) for one metadata entry."""
    out: list[dict[str, Any]] = []
    if vtype in INTEGER_RANGE:
        low, high = INTEGER_RANGE[vtype]
        (current,) = struct.unpack(SCALAR[vtype], raw)
        for value in sorted({0, 1, high, low, current + 1, current * 2, 2**31 - 1}):
            if low <= value <= high:
                out.append({"vtype": vtype, "value": value})
        if low == 0:  # a negative value in the signed type of the same size
            out.append({"vtype": {U8: I8, U16: I16, U32: I32, U64: I64}[vtype], "value": -1})
    elif vtype in (F32, F64):
        for value in (0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e30, 1e-45):
            out.append({"vtype": vtype, "value": value})
    elif vtype == BOOL:
        for value in (0, 1, 2, 255):
            out.append({"vtype": U8, "value": value, "as": BOOL})
    elif vtype == STRING:
        values = ["", "a\0b", "x" * 70_000, "\udcff"]
        if key == b"general.architecture":
            values += list(ARCHITECTURES)
        if key == b"tokenizer.ggml.model":
            values += list(TOKENIZERS)
        for value in values:
            out.append({"vtype": STRING, "value": value})
    elif vtype == ARRAY:
        etype, _ = struct.unpack_from("<IQ", raw, 0)
        out.append({"vtype": ARRAY, "etype": etype, "items": []})
        out.append({"vtype": ARRAY, "op": "drop_last"})
        out.append({"vtype": ARRAY, "op": "duplicate_first"})
        if etype != STRING:
            fills: list[float] = [0, 1, -1, 2**31 - 1, math.nan]
            if key.endswith(b"token_type"):
                fills += [3, 6]  # every token a control token, every token a byte token
            for value in fills:
                out.append({"vtype": ARRAY, "op": "fill", "value": value})
        if etype == STRING:
            out.append({"vtype": ARRAY, "op": "blank_first"})
    # Another type altogether
    others = ((U8, 1), (I32, -1), (U64, 2**40), (F32, 0.5), (BOOL, True), (STRING, "1"),
              (ARRAY, (U32, [1, 2])), (ARRAY, (STRING, ["x"])))  # fmt: skip
    for other, value in others:
        if other != vtype:
            out.append({"vtype": other, "value": list(value) if other == ARRAY else value})
    return out


def loader_keys(source: Path) -> list[str]:
    """Every metadata key llama.cpp's loader knows (LLM_KV_NAMES in the pinned
    src/llama-arch.cpp; "%s" stands for the architecture)."""
    text = (source / "src" / "llama-arch.cpp").read_text()
    table = text[text.index("LLM_KV_NAMES") :]
    table = table[: table.index("};")]
    return sorted(set(re.findall(r'\{\s*LLM_KV_\w+,\s*"([^"]+)"\s*\}', table)))


# A value of each type the loader's getters take: scalars at their edges, per-layer arrays
# (one entry per layer, or one too many), and label or token lists of growing length.
_ADDED_VALUES = (
    *((U32, value) for value in (0, 1, 7, 1000, 2**32 - 1)),
    (I32, -1),
    *((F32, value) for value in (0.0, -1.0, math.nan, math.inf, 1e30)),
    (BOOL, True),
    (BOOL, False),
    (STRING, ""),
    (STRING, "x" * 300),
)


def added_keys(header: Header, keys: list[str]) -> list[dict[str, Any]]:
    """Variants adding each of ``keys`` the file lacks, with each of a few values of every type
    llama.cpp's getters read: keys an architecture reads only when present (a classifier's
    labels, an output width, per-layer patterns) are what the other variants never reach."""
    values = {key.decode(errors="replace"): (vtype, raw) for key, vtype, raw in header.kvs}
    arch_type, arch_raw = values.get("general.architecture", (STRING, encode_string(b"")))
    arch = arch_raw[8:].decode(errors="replace") if arch_type == STRING else ""
    count_type, count_raw = values.get(f"{arch}.block_count", (U32, struct.pack("<I", 1)))
    n_layer = struct.unpack(SCALAR[count_type], count_raw)[0] if count_type in SCALAR else 1
    present = set(values)
    specs: list[dict[str, Any]] = []
    for template in keys:
        key = template.replace("%s", arch)
        if key in present or key.startswith("split."):
            continue
        for vtype, value in _ADDED_VALUES:
            specs.append({"kind": "kv_add", "key": key, "vtype": vtype, "value": value})
        for fill in (0, 1, 2**31 - 1):
            for count in (n_layer, n_layer + 1):
                specs.append({"kind": "kv_add", "key": key, "vtype": ARRAY,
                              "value": [U32, [fill] * count]})  # fmt: skip
        for count in (1, 2, 65, 1000):
            specs.append({"kind": "kv_add", "key": key, "vtype": ARRAY,
                          "value": [STRING, [f"label {i}" for i in range(count)]]})  # fmt: skip
    return specs


# -- building a variant -------------------------------------------------------------------------


def _array_edit(raw: bytes, op: str, value: Any) -> bytes:
    etype, count = struct.unpack_from("<IQ", raw, 0)
    body = raw[12:]
    if etype == STRING:
        items, at = [], 0
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", body, at)
            items.append(body[at : at + 8 + length])
            at += 8 + length
        if op == "drop_last":
            items = items[:-1]
        elif op == "duplicate_first" and items:
            items = [items[0], *items]
        elif op == "blank_first" and items:
            items = [encode_string(b""), *items[1:]]
        return struct.pack("<IQ", etype, len(items)) + b"".join(items)
    size = struct.calcsize(SCALAR[etype])
    items = [body[i : i + size] for i in range(0, count * size, size)]
    if op == "drop_last":
        items = items[:-1]
    elif op == "duplicate_first" and items:
        items = [items[0], *items]
    elif op == "fill":
        items = [_fit(etype, value)] * len(items)
    return struct.pack("<IQ", etype, len(items)) + b"".join(items)


def _fit(vtype: int, value: Any) -> bytes:
    """``value`` in type ``vtype``, wrapped or saturated to fit."""
    if vtype in (F32, F64):
        return struct.pack(SCALAR[vtype], float(value))
    if vtype == BOOL:
        return struct.pack("<B", 1 if value else 0)
    if isinstance(value, float):
        value = 0 if math.isnan(value) else int(value)
    low, high = INTEGER_RANGE[vtype]
    return struct.pack(SCALAR[vtype], (value - low) % (high - low + 1) + low)


def build_header(base: Header, spec: dict[str, Any], length: int) -> bytes:
    """The variant's header, ``length`` bytes long (the padding key absorbs the difference)."""
    header = Header(base.version, list(base.kvs), list(base.tensors), base.data_offset,
                    base.alignment)  # fmt: skip
    kind = spec["kind"]
    if kind == "kv":
        key, vtype, raw = header.kvs[spec["index"]]
        if spec.get("op"):
            header.kvs[spec["index"]] = (
                key,
                ARRAY,
                _array_edit(raw, spec["op"], spec.get("value")),
            )
        elif "items" in spec:
            header.kvs[spec["index"]] = (key, ARRAY, encode_value(ARRAY, (spec["etype"], [])))
        else:
            new_type = spec["vtype"]
            value = spec["value"]
            if new_type == ARRAY:
                value = (value[0], value[1])
            elif new_type == STRING:
                value = value.encode("utf-8", "surrogateescape")
            raw_value = encode_value(new_type, value)
            header.kvs[spec["index"]] = (key, spec.get("as", new_type), raw_value)
    elif kind == "kv_remove":
        del header.kvs[spec["index"]]
    elif kind == "kv_rename":
        key, vtype, raw = header.kvs[spec["index"]]
        header.kvs[spec["index"]] = (spec["to"].encode(), vtype, raw)
    elif kind == "kv_add":
        value = spec["value"]
        vtype = spec["vtype"]
        header.kvs.insert(0, (spec["key"].encode(), vtype, encode_value(vtype, value)))
    elif kind == "tensor":
        name, dims, ttype, offset = header.tensors[spec["index"]]
        header.tensors[spec["index"]] = (
            spec["name"].encode() if "name" in spec else name,
            spec.get("dims", dims), spec.get("type", ttype), spec.get("offset", offset),
        )  # fmt: skip
    elif kind == "tensor_remove":
        del header.tensors[spec["index"]]
    elif kind == "tensor_duplicate":
        header.tensors.insert(spec["index"], header.tensors[spec["index"]])
    # Pad to the exact length: the padding string grows or shrinks by the difference.
    probe = padded(header, 0).encode()
    pad = length - len(probe)
    if pad < 0:
        raise ValueError(f"variant {spec} does not fit the padding")
    fitted = padded(header, pad)
    data = bytearray(fitted.encode())
    assert len(data) == length
    if kind == "raw":
        patch = bytes.fromhex(spec["data"])
        data[spec["at"] : spec["at"] + len(patch)] = patch
    elif kind == "field":
        at = fitted.fields[spec["name"]] + spec.get("skip", 0)
        width = spec.get("width", 8 if spec["name"].endswith(("_len", "dims")) else 4)
        data[at : at + width] = (spec["value"] % 2 ** (8 * width)).to_bytes(width, "little")
    elif kind == "bytes":
        for position, value in spec["edits"]:
            data[position] = value
    return bytes(data)


@dataclass
class WorkFile:
    """One slot's copy of a model with a padded header; variants are written over it."""

    original: Path
    path: Path
    header: Header
    length: int  # the padded header's length
    data_offset: int  # where the tensor data starts in the work file

    @classmethod
    def create(cls, original: Path, directory: Path, slot: int) -> WorkFile:
        header = parse(original)
        base = padded(header, PAD_BYTES)
        head = base.encode()
        data_offset = -(-len(head) // header.alignment) * header.alignment
        path = directory / f"{original.stem}-slot{slot}.gguf"
        expected = data_offset + original.stat().st_size - header.data_offset
        if not path.exists() or path.stat().st_size != expected:
            partial = path.with_suffix(f".{os.getpid()}.part")
            with open(original, "rb") as source, open(partial, "wb") as out:
                out.write(head + b"\0" * (data_offset - len(head)))
                source.seek(header.data_offset)
                shutil.copyfileobj(source, out, 16 << 20)
            partial.replace(path)
        work = cls(original, path, header, len(head), data_offset)
        work.repair()
        return work

    def repair(self) -> None:
        """Put back the tensors data variants change, in case a child died before it could."""
        with open(self.original, "rb") as source, open(self.path, "r+b") as out:
            for _, dims, ttype, offset in self.header.tensors:
                if ttype == 0 and len(dims) == 1:  # the small f32 tensors (norms)
                    source.seek(self.header.data_offset + offset)
                    out.seek(self.data_offset + offset)
                    out.write(source.read(4 * dims[0]))

    def prepare(self, spec: dict[str, Any], scratch: Path) -> tuple[Path, Any]:
        """The path to load for ``spec``, and what ``restore`` needs to undo it."""
        kind = spec["kind"]
        if kind == "truncate":
            head = build_header(self.header, {"kind": "none"}, self.length)
            with open(self.path, "rb") as file:
                file.seek(self.length)
                head += file.read(max(0, spec["at"] - self.length))
            scratch.write_bytes(head[: spec["at"]])
            return scratch, None
        head = build_header(self.header, spec, self.length)
        with open(self.path, "r+b") as file:
            file.write(head)
        if kind == "truncate_data":
            size = self.path.stat().st_size
            keep = spec["keep"]
            cut = size - 1 if keep < 0 else self.data_offset + keep
            os.truncate(self.path, cut)
            return self.path, ("truncated", cut)
        if kind == "data":
            _, dims, _, offset = self.header.tensors[spec["index"]]
            count = math.prod(dims)
            at = self.data_offset + offset
            with open(self.path, "r+b") as file:
                file.seek(at)
                saved = file.read(4 * count)
                file.seek(at)
                file.write(struct.pack("<f", spec["value"]) * count)
            return self.path, ("data", at, saved)
        return self.path, None

    def restore(self, undo: Any) -> None:
        if undo is None:
            return
        if undo[0] == "truncated":
            cut = undo[1]
            with open(self.original, "rb") as source, open(self.path, "ab") as out:
                source.seek(self.header.data_offset + cut - self.data_offset)
                shutil.copyfileobj(source, out, 16 << 20)
        else:
            _, at, saved = undo
            with open(self.path, "r+b") as file:
                file.seek(at)
                file.write(saved)


# -- the child's side ---------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    directory = Path(config["workdir"])
    directory.mkdir(parents=True, exist_ok=True)
    work = WorkFile.create(Path(config["model"]), directory, slot)
    return {"work": work, "scratch": directory / f"scratch-{os.getpid()}.gguf",
            "prompt": config.get("prompt", "the cat"), "base": config.get("base"),
            "use": config.get("use")}  # fmt: skip


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """Load the variant and decode with it (``use`` "embeddings": embed with it; "both": decode,
    then embed); a LlamaError (raised out of here) is the expected refusal."""
    from llamacrab import Llama

    work: WorkFile = state["work"]
    path, undo = work.prepare(case["spec"], state["scratch"])
    try:
        if state["base"] is not None:  # a projector or an adapter of that model
            return _with_base_case(path, state)
        if state["use"] == "embeddings":
            return embeddings_case(path, state)
        with Llama(path, n_ctx=64, n_batch=64, n_threads=1) as llm:
            detail = "loaded; " + completion_case(llm, state["prompt"])
            llm.tokenize("<start_of_turn>user é🙂<s>", parse_special=True)
            n_vocab = llm.vocab.n_tokens
            llm.detokenize(list(range(0, n_vocab, max(1, n_vocab // 64))), special=True)
        if state["use"] == "both":
            detail += "; " + embeddings_case(path, state)[1]
        return "ok", detail
    finally:
        work.restore(undo)


def digest(values: Any) -> str:
    """A short digest of what a case computed (its repr: floats in full), which a run of the
    case on another heap compares (sections.run_again)."""
    return hashlib.sha256(repr(values).encode()).hexdigest()[:12]


def completion_case(llm: Any, prompt: str) -> str:
    """Two greedy tokens with their log-probabilities: how many, and a digest of what."""
    choice = llm.create_completion(prompt, max_tokens=2, temperature=0, logprobs=1).choices[0]
    values = (choice.text, choice.logprobs.token_logprobs if choice.logprobs else None)
    return f"{len(choice.tokens)} tokens ({digest(values)})"


def embeddings_case(path: Path, state: dict[str, Any]) -> tuple[str, str]:
    """Embeddings of two texts with the model's own pooling, then mean pooling; with rank
    pooling, also a reranking and a classification."""
    from llamacrab import Llama

    texts = [state["prompt"], "a crab"]
    widths, computed = [], []
    for pooling in ("unspecified", "mean"):
        with Llama(path, n_ctx=64, n_batch=64, n_threads=1, embeddings=True,
                   pooling=pooling) as llm:  # fmt: skip
            vectors = llm.embed(texts)
            widths.append(str(vectors[0].shape[-1]))
            computed += [vector.tolist() for vector in vectors]
            if llm.context.pooling == "rank":
                computed.append(llm.rerank(texts[0], texts))
                computed.append(llm.classify([(texts[0], texts[1])]))
    return "ok", f"embedded ({', '.join(widths)} wide; {digest(computed)})"


def _with_base_case(path: Path, state: dict[str, Any]) -> tuple[str, str]:
    """Load the variant with the base model: as its LoRA adapter, applied to a completion, or
    as its projector, given an image or a sound."""
    import numpy as np

    from llamacrab import Audio, Image, Llama

    use = state["use"]
    if use == "quantize":
        return _quantized_with(path, state)
    if use in ("lora", "control vector"):
        file = {"lora": [str(path)]} if use == "lora" else {"control_vectors": [str(path)]}
        with Llama(state["base"], n_ctx=128, n_threads=1, **file) as llm:
            completion = llm.create_completion(state["prompt"], max_tokens=2, temperature=0)
        return "ok", f"applied; {completion.usage.completion_tokens} tokens"
    if use == "audio":
        tone = np.sin(np.arange(8000, dtype=np.float32) * 0.2) * 0.5
        media: Any = Audio(samples=tone, sample_rate=16000)
    else:
        media = Image(pixels=np.full((24, 32, 3), 120, np.uint8))
    with Llama(state["base"], n_ctx=1024, n_threads=1, mmproj=path) as llm:
        completion = llm.create_completion(f"{llm.media_marker} then", media=[media],
                                           max_tokens=2, temperature=0)  # fmt: skip
    return "ok", f"loaded; {completion.usage.prompt_tokens} prompt tokens"


def _quantized_with(imatrix: Path, state: dict[str, Any]) -> tuple[str, str]:
    """Quantize the base model with the variant as its importance matrix, then complete with
    the output. quantize() runs llama.cpp in a process of its own, whose death on a signal
    it reports as a QuantizationError: a crash all the same, raised here as one."""
    from llamacrab import Llama, QuantizationError, quantize

    output = Path(state["scratch"]).with_suffix(".q4_0.gguf")
    try:
        quantize(state["base"], output, "Q4_0", threads=1, imatrix=imatrix)
    except QuantizationError as error:
        if "ended on signal" in str(error):
            raise RuntimeError(f"quantize's process crashed: {error}") from error
        raise
    try:
        with Llama(output, n_ctx=64, n_threads=1) as llm:
            completion = llm.create_completion(state["prompt"], max_tokens=2, temperature=0)
    finally:
        output.unlink(missing_ok=True)
    return "ok", f"quantized; {completion.usage.completion_tokens} tokens"


def cases(
    model: Path, label: str, seed: int, count: int | None, *, tampered: bool = True,
    keys: list[str] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The variant cases of ``model`` (a sample of ``count`` if given, always the same): its
    tampered variants, then (given llama.cpp's ``keys``) the added-key ones."""
    header = parse(model)
    specs = variants(header, model.stat().st_size, seed) if tampered else []
    specs += added_keys(header, keys or [])
    if count is not None and count < len(specs):
        specs = random.Random(seed).sample(specs, count)
    return [{"id": f"{label}-{i}", "spec": spec} for i, spec in enumerate(specs)]
