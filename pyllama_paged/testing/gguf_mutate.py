"""Structure-aware GGUF mutations for the GGUF loader fuzzer (gguf_fuzz.py).

A seed file is parsed into a ``Doc`` (header, key/values with their GGUF types,
tensor infos, data blob). A case is a *recipe*: the seed's name plus a list of
operations, each a JSON-able list ``[op, *args]``. Operations either edit the
Doc before it is written (``kv``, ``tensor``, ``counts``...) or edit the written
bytes (``field`` overwrites one recorded length/type/count field with a lie,
``flip``, ``truncate``, ``splice``). Recipes are explicit, so a failing case
replays from its recipe alone, whatever the random generator does later; the
generator (``random_recipe``) only picks operations and arguments.
"""

from __future__ import annotations

import copy
import math
import random
import re
import struct
from dataclasses import dataclass
from typing import Any

# GGUF value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
              U64: "Q", I64: "q", F64: "d"}
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
FLOAT_TYPES = (F32, F64)


@dataclass
class KV:
    key: bytes
    vtype: int
    value: Any  # scalar: number/bool; string: bytes; array: (etype, [items])


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int  # relative to the start of the data section


@dataclass
class Doc:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data: bytes
    magic: bytes = b"GGUF"
    n_tensors: int | None = None  # header count overrides (None: the real count)
    n_kv: int | None = None
    alignment: int = 32           # padding used when writing (not the KV's value)

    def kv_index(self, key: str) -> int | None:
        k = key.encode()
        return next((i for i, kv in enumerate(self.kvs) if kv.key == k), None)

    def tensor_index(self, name: str) -> int | None:
        n = name.encode()
        return next((i for i, t in enumerate(self.tensors) if t.name == n), None)


# --------------------------------------------------------------------------- parse / write

def parse(data: bytes) -> Doc:
    """Parse a *valid* GGUF (a seed); no error handling on purpose."""
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n]
        pos += n
        return s

    def value(vtype):
        if vtype == STRING:
            return string()
        if vtype == ARRAY:
            etype, count = take("I"), take("Q")
            return (etype, [value(etype) for _ in range(count)])
        return take(SCALAR_FMT[vtype])

    assert data[:4] == b"GGUF"
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    kvs = []
    for _ in range(n_kv):
        key = string()
        vtype = take("I")
        kvs.append(KV(key, vtype, value(vtype)))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("I")
        dims = [take("Q") for _ in range(n_dims)]
        tensors.append(TensorInfo(name, dims, take("I"), take("Q")))
    doc = Doc(version, kvs, tensors, b"")
    ai = doc.kv_index("general.alignment")
    doc.alignment = doc.kvs[ai].value if ai is not None else 32
    start = -(-pos // doc.alignment) * doc.alignment
    doc.data = data[start:]
    return doc


class _Writer:
    """Appends little-endian fields and records where each interesting one is."""

    def __init__(self):
        self.buf = bytearray()
        self.fields: list[tuple[str, int, str]] = []  # (kind, offset, struct code)

    def put(self, code: str, value, kind: str | None = None) -> None:
        if kind:
            self.fields.append((kind, len(self.buf), code))
        self.buf += struct.pack("<" + code, value)

    def string(self, s: bytes, kind: str) -> None:
        self.put("Q", len(s), kind)
        self.buf += s

    def value(self, vtype: int, v, where: str) -> None:
        if vtype == STRING:
            self.string(v, where + "str_len")
        elif vtype == ARRAY:
            etype, items = v
            self.put("I", etype, "arr_type")
            self.put("Q", len(items), "arr_count")
            for item in items:
                self.value(etype, item, "item_")
        elif vtype in SCALAR_FMT:
            self.put(SCALAR_FMT[vtype], _fit(vtype, v), "scalar" if where == "" else None)
        # an unknown type id: nothing follows it (that is the lie)


def _fit(vtype: int, v):
    """Coerce a value into what struct can pack for the type (wrapping ints)."""
    code = SCALAR_FMT[vtype]
    if code == "f":  # beyond float32's range: +-inf, as a float32 field can hold
        v = float(v)
        return v if abs(v) <= 3.4028234663852886e38 or v != v else math.copysign(math.inf, v)
    if code == "d":
        return float(v)
    if code == "?":
        return bool(v)
    bits = struct.calcsize(code) * 8
    v = int(v) % (1 << bits)
    if code.islower() and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def write(doc: Doc) -> tuple[bytearray, list[tuple[str, int, str]], int]:
    """Bytes of doc, the recorded fields and where the data section starts."""
    w = _Writer()
    w.buf += doc.magic
    w.put("I", doc.version, "version")
    w.put("Q", len(doc.tensors) if doc.n_tensors is None else doc.n_tensors, "n_tensors")
    w.put("Q", len(doc.kvs) if doc.n_kv is None else doc.n_kv, "n_kv")
    for kv in doc.kvs:
        w.string(kv.key, "key_len")
        w.put("I", kv.vtype, "vtype")
        w.value(kv.vtype, kv.value, "")
    for t in doc.tensors:
        w.string(t.name, "name_len")
        w.put("I", len(t.dims), "n_dims")
        for d in t.dims:
            w.put("Q", d % (1 << 64), "dim")
        w.put("I", t.ttype % (1 << 32), "ttype")
        w.put("Q", t.offset % (1 << 64), "offset")
    align = doc.alignment if doc.alignment > 0 else 32
    data_start = -(-len(w.buf) // align) * align
    w.buf += bytes(data_start - len(w.buf))
    w.buf += doc.data
    return w.buf, w.fields, data_start


# --------------------------------------------------------------------------- JSON values

def decode_value(vtype: int, spec):
    """A recipe's JSON value -> the Doc's form (bytes for strings, (etype, items) arrays)."""
    if vtype == STRING:
        if isinstance(spec, dict):
            return bytes.fromhex(spec["hex"]) * spec.get("repeat", 1)
        return str(spec).encode("utf-8")
    if vtype == ARRAY:
        etype = spec["etype"]
        if "fill" in spec:
            items = [decode_value(etype, spec["fill"])] * spec["count"]
        else:
            items = [decode_value(etype, s) for s in spec["items"]]
        return (etype, items)
    if vtype in FLOAT_TYPES and isinstance(spec, str):
        return float(spec)  # "nan", "inf", "-inf"
    if vtype not in SCALAR_FMT:
        return spec  # an unknown type: written as nothing but its type id
    return spec


# --------------------------------------------------------------------------- operations

def _op_kv(doc: Doc, key: str, vtype: int, spec) -> None:
    """Set (or add) key to a value of any type."""
    value = decode_value(vtype, spec)
    i = doc.kv_index(key)
    if i is None:
        doc.kvs.append(KV(key.encode(), vtype, value))
    else:
        doc.kvs[i] = KV(doc.kvs[i].key, vtype, value)


def _drop(items: list, i: int | None) -> None:
    """Remove items[i]; None (the target is absent) changes nothing."""
    if i is not None:
        del items[i]


def _duplicate(items: list, i: int | None) -> None:
    """Insert a copy of items[i] right after it; None changes nothing."""
    if i is not None:
        items.insert(i + 1, copy.deepcopy(items[i]))


def _op_kv_drop(doc: Doc, key: str) -> None:
    _drop(doc.kvs, doc.kv_index(key))


def _op_kv_dup(doc: Doc, key: str) -> None:
    _duplicate(doc.kvs, doc.kv_index(key))


def _op_kv_unknown_type(doc: Doc, key: str, vtype: int) -> None:
    """Retag a field with a type id GGUF does not have (no value bytes follow)."""
    i = doc.kv_index(key)
    if i is not None:
        doc.kvs[i] = KV(doc.kvs[i].key, vtype, None)


def _op_array_resize(doc: Doc, key: str, n: int) -> None:
    """Shorten an array, or grow it by repeating its last item."""
    i = doc.kv_index(key)
    if i is None or doc.kvs[i].vtype != ARRAY:
        return
    etype, items = doc.kvs[i].value
    if n <= len(items):
        items = items[:n]
    else:
        filler = items[-1] if items else decode_value(etype, 0 if etype != STRING else "x")
        items = items + [filler] * (n - len(items))
    doc.kvs[i] = KV(doc.kvs[i].key, ARRAY, (etype, items))


def _op_array_item(doc: Doc, key: str, index: int, spec) -> None:
    """Replace one item of an array (index taken modulo the length)."""
    i = doc.kv_index(key)
    if i is None or doc.kvs[i].vtype != ARRAY or not doc.kvs[i].value[1]:
        return
    etype, items = doc.kvs[i].value
    items = list(items)
    items[index % len(items)] = decode_value(etype, spec)
    doc.kvs[i] = KV(doc.kvs[i].key, ARRAY, (etype, items))


def _op_tensor(doc: Doc, name: str, what: str, value) -> None:
    """Change one tensor info: name (str or {"hex"}), dims (list), ttype or offset."""
    i = doc.tensor_index(name)
    if i is None:
        return
    t = doc.tensors[i]
    if what == "name":
        t.name = decode_value(STRING, value)
    elif what == "dims":
        t.dims = list(value)
    elif what == "ttype":
        t.ttype = value
    elif what == "offset":
        t.offset = value
    elif what == "offset_add":
        t.offset += value


def missing_tensor_case(name: str) -> tuple[list, str]:
    """A malformed-file case: the ops that drop tensor name, and the error they must bring."""
    return [["tensor_drop", name]], rf"missing tensor '{re.escape(name)}'"


def _op_tensor_drop(doc: Doc, name: str) -> None:
    _drop(doc.tensors, doc.tensor_index(name))


def _op_tensor_dup(doc: Doc, name: str) -> None:
    _duplicate(doc.tensors, doc.tensor_index(name))


def _op_counts(doc: Doc, n_tensors: int | None, n_kv: int | None) -> None:
    """Header counts that disagree with what follows."""
    doc.n_tensors, doc.n_kv = n_tensors, n_kv


def _op_header(doc: Doc, magic_hex: str | None, version: int | None) -> None:
    if magic_hex is not None:
        doc.magic = bytes.fromhex(magic_hex)
    if version is not None:
        doc.version = version


DOC_OPS = {
    "kv": _op_kv, "kv_drop": _op_kv_drop, "kv_dup": _op_kv_dup, "kv_unknown_type": _op_kv_unknown_type,
    "array_resize": _op_array_resize, "array_item": _op_array_item,
    "tensor": _op_tensor, "tensor_drop": _op_tensor_drop, "tensor_dup": _op_tensor_dup,
    "counts": _op_counts, "header": _op_header,
}
BYTE_OPS = ("field", "flip", "truncate", "splice_delete", "splice_insert")


def _apply_bytes(buf: bytearray, fields, op: list) -> bytearray:
    name, args = op[0], op[1:]
    if name == "field":  # ["field", kind, ordinal, value]: a lie in one recorded field
        kind, ordinal, value = args
        matching = [f for f in fields if f[0] == kind]
        if matching:
            _, off, code = matching[ordinal % len(matching)]
            size = struct.calcsize("<" + code)
            if code in "fd":
                packed = struct.pack("<" + code, float(value))
            else:
                packed = (int(value) % (1 << (8 * size))).to_bytes(size, "little")
            buf[off:off + size] = packed
    elif name == "flip":  # ["flip", offset, xor]
        off, xor = args
        if buf:
            buf[off % len(buf)] ^= xor & 0xFF or 1
    elif name == "truncate":  # ["truncate", length]
        del buf[args[0]:]
    elif name == "splice_delete":  # ["splice_delete", offset, n]
        del buf[args[0]:args[0] + args[1]]
    elif name == "splice_insert":  # ["splice_insert", offset, hex]
        buf[args[0]:args[0]] = bytes.fromhex(args[1])
    else:
        raise KeyError(f"unknown operation {name!r}")
    return buf


def build(seed_doc: Doc, ops: list[list]) -> bytes:
    """The bytes of a case: doc operations first, then byte operations, in order."""
    doc = copy.deepcopy(seed_doc)
    byte_ops = []
    for op in ops:
        if op[0] in BYTE_OPS:
            byte_ops.append(op)
        else:
            DOC_OPS[op[0]](doc, *op[1:])
    buf, fields, _ = write(doc)
    for op in byte_ops:
        buf = _apply_bytes(buf, fields, op)
    return bytes(buf)


# --------------------------------------------------------------------------- random recipes

# Field values that break size arithmetic: around 2^31/2^32/2^63/2^64, and the
# ones that make products of two dims overflow int64.
BIG = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**53, 2**62, 2**63 - 1, 2**63,
       2**64 - 1, 2**64 - 2]
SMALL = [0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 63, 64, 255, 256, 257, 511, 512, 513, 4096]
FLOATS = ["nan", "inf", "-inf", 0.0, -0.0, 1.0, -1.0, 1e-45, 1e-30, 3.4e38, 1e308, 0.5, 2.0, 1e6]
STRINGS = ["", "llama", "gemma3", "qwen2", "qwen3", "mamba", "gpt2", "bert", "none", "linear", "yarn",
           "default", "qwen2", "llama-bpe", "x" * 300, {"hex": "ff"}, {"hex": "c3"}, {"hex": "00"},
           "{{", "{% if %}", "{% for m in messages %}{{ m.content }}", "{{ raise_exception('x') }}",
           "<0x41>", "<0xZZ>", "<0x", "▁", "a b", " ", {"hex": "e29681", "repeat": 3}]
HPARAM_SUFFIXES = [
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "attention.sliding_window",
    "attention.query_pre_attn_scalar", "final_logit_softcapping", "vocab_size",
]
TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
]
ARRAY_KEYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges"]
FIELD_KINDS = ["version", "n_tensors", "n_kv", "key_len", "vtype", "str_len", "arr_type", "arr_count",
               "item_str_len", "scalar", "name_len", "n_dims", "dim", "ttype", "offset"]


def random_int(rng: random.Random, around: int | None = None) -> int:
    r = rng.random()
    if r < 0.35:
        return rng.choice(SMALL)
    if r < 0.6:
        v = rng.choice(BIG)
        return -v if rng.random() < 0.2 else v
    if around is not None and r < 0.85:
        return around + rng.choice([-2, -1, 1, 2, around, -around, 32, 256])
    return rng.randrange(-(2**16), 2**16)


def random_value(rng: random.Random, depth: int = 0) -> tuple[int, Any]:
    """A (vtype, JSON spec) of any GGUF type, biased to boundary values."""
    vtype = rng.choice([U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64, U32, I32,
                        STRING, ARRAY])
    if vtype == STRING:
        return vtype, rng.choice(STRINGS)
    if vtype == ARRAY:
        if depth > 1:
            return U32, rng.choice(SMALL)
        etype, _ = random_value(rng, depth + 1)
        count = rng.choice([0, 1, 2, 3, 5])
        items = [random_value_of(rng, etype, depth + 1) for _ in range(count)]
        return vtype, {"etype": etype, "items": items}
    return vtype, random_value_of(rng, vtype, depth)


def random_value_of(rng: random.Random, vtype: int, depth: int = 0):
    if vtype in FLOAT_TYPES:
        return rng.choice(FLOATS)
    if vtype == BOOL:
        return rng.random() < 0.5
    if vtype == STRING:
        return rng.choice(STRINGS)
    if vtype == ARRAY:
        etype = rng.choice([U32, I32, F32, STRING, U8])
        return {"etype": etype, "items": [random_value_of(rng, etype, depth + 1) for _ in range(2)]}
    return random_int(rng)


def _pick_key(rng: random.Random, doc: Doc) -> str:
    arch = next((kv.value.decode() for kv in doc.kvs if kv.key == b"general.architecture"), "llama")
    r = rng.random()
    if r < 0.4:
        return f"{arch}.{rng.choice(HPARAM_SUFFIXES)}"
    if r < 0.75:
        return rng.choice(TOKENIZER_KEYS)
    if r < 0.85:
        return rng.choice(["general.alignment", "general.architecture"])
    return rng.choice(doc.kvs).key.decode("utf-8", "replace")


def _tensor_op(rng: random.Random, doc: Doc, data_len: int) -> list:
    t = rng.choice(doc.tensors)
    name = t.name.decode()
    r = rng.random()
    if r < 0.35:
        dims = list(t.dims)
        how = rng.random()
        if how < 0.4 and dims:
            dims[rng.randrange(len(dims))] = random_int(rng, around=dims[0]) % (1 << 64)
        elif how < 0.6:  # two dims whose product overflows int64
            big = rng.choice(BIG[3:])
            dims = [dims[0] if dims else 32, big, rng.choice([2**31, 2**32, 2**33, 3])]
        elif how < 0.8:
            n = rng.choice([0, 1, 3, 4, 5, 8])
            dims = (dims + [1] * 8)[:n]
        else:
            dims = [d * rng.choice([2, 0]) for d in dims] or [0]
        return ["tensor", name, "dims", dims]
    if r < 0.55:
        return ["tensor", name, "ttype", rng.choice(list(range(0, 42)) + [2**31, 2**32 - 1, 1000])]
    if r < 0.8:
        choice = rng.random()
        if choice < 0.3:
            return ["tensor", name, "offset_add", rng.choice([1, 2, 16, 31, 32, -32, -1])]
        if choice < 0.6:
            return ["tensor", name, "offset", rng.choice([data_len, data_len - 1, data_len + 32, 0])]
        return ["tensor", name, "offset", rng.choice(BIG)]
    if r < 0.9:
        return ["tensor", name, "name", rng.choice(
            ["", "blk.0.attn_q.weight", "blk.99.attn_q.weight", "blk.-1.attn_q.weight",
             "blk.4294967296.attn_q.weight", "token_embd.weight", "output.weight", "rope_freqs.weight",
             {"hex": "626c6b2e302e00"}, {"hex": "ff"}, "x" * 200, "blk.0.attn_q.weight\u0000x"])]
    return [rng.choice(["tensor_drop", "tensor_dup"]), name]


def random_recipe(rng: random.Random, seed_names: list[str], docs: dict[str, Doc],
                  sizes: dict[str, tuple[int, int]]) -> dict:
    """One case: a seed and 1-3 operations. sizes[name] = (header bytes, file bytes)."""
    seed = rng.choice(seed_names)
    doc = docs[seed]
    header_len, file_len = sizes[seed]
    ops = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        r = rng.random()
        if r < 0.22:
            key = _pick_key(rng, doc)
            vtype, spec = random_value(rng)
            ops.append(["kv", key, vtype, spec])
        elif r < 0.27:
            ops.append([rng.choice(["kv_drop", "kv_dup"]), _pick_key(rng, doc)])
        elif r < 0.29:
            ops.append(["kv_unknown_type", _pick_key(rng, doc), rng.choice([13, 14, 255, 2**31, 2**32 - 1])])
        elif r < 0.35:
            key = rng.choice(ARRAY_KEYS)
            i = doc.kv_index(key)
            n = len(doc.kvs[i].value[1]) if i is not None else 4
            ops.append(["array_resize", key, rng.choice([0, 1, n - 1, n + 1, 2 * n])])
        elif r < 0.4:
            key = rng.choice(ARRAY_KEYS)
            i = doc.kv_index(key)
            if i is None:
                continue
            etype = doc.kvs[i].value[0]
            ops.append(["array_item", key, rng.randrange(1 << 16), random_value_of(rng, etype)])
        elif r < 0.55:
            ops.append(_tensor_op(rng, doc, len(doc.data)))
        elif r < 0.58:
            nt, nk = len(doc.tensors), len(doc.kvs)
            ops.append(["counts", rng.choice([None, nt + 1, nt - 1, 0, random_int(rng) % (1 << 64)]),
                        rng.choice([None, nk + 1, nk - 1, 0, random_int(rng) % (1 << 64)])])
        elif r < 0.6:
            ops.append(["header", rng.choice([None, None, "47475546", "46554747", "00000000"]),
                        rng.choice([None, 1, 2, 3, 4, 2**32 - 1])])
        elif r < 0.78:
            ops.append(["field", rng.choice(FIELD_KINDS), rng.randrange(1 << 16),
                        rng.choice([random_int(rng) % (1 << 64), rng.choice(BIG), rng.choice(SMALL),
                                    file_len, file_len + 1, header_len])])
        elif r < 0.88:
            # Flips land in the header (strings, counts, types) far more often
            # than in weights, where any value is a valid float.
            limit = header_len if rng.random() < 0.85 else file_len
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                ops.append(["flip", rng.randrange(limit), rng.randrange(1, 256)])
        elif r < 0.95:
            limit = header_len if rng.random() < 0.7 else file_len
            ops.append(["truncate", rng.randrange(limit)])
        else:
            off = rng.randrange(header_len)
            if rng.random() < 0.5:
                ops.append(["splice_delete", off, rng.choice([1, 2, 4, 8, 13, 100])])
            else:
                ops.append(["splice_insert", off, bytes(rng.randrange(256) for _ in range(
                    rng.choice([1, 4, 8]))).hex()])
    return {"seed": seed, "ops": ops}

