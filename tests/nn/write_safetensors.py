#!/usr/bin/env python3
"""An independent safetensors writer (standard library only: json and struct).

Writes the tensors test_safetensors.cpp expects, with values from simple
formulas, keys in a scrambled order, __metadata__, and the header padded with
spaces as the Hugging Face library does.
"""
import json
import struct
import sys


def f32(n):
    return [i * 0.25 - 3.0 for i in range(n)]


def bf16_bits(x):
    # float32 bits, rounded to nearest even in the top 16 bits.
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def main(path):
    tensors = [
        # name, dtype, shape, bytes
        ("z.f32", "F32", [3, 5], struct.pack("<15f", *f32(15))),
        ("a.f64", "F64", [7], struct.pack("<7d", *[1.0 / (i + 1) for i in range(7)])),
        ("m.bf16", "BF16", [2, 3], struct.pack("<6H", *[bf16_bits(v) for v in f32(6)])),
        ("m.f16", "F16", [4], struct.pack("<4e", 0.5, -2.0, 65504.0, 1e-3)),
        ("i.i64", "I64", [2, 2], struct.pack("<4q", -(2**40), 7, 0, 2**50)),
        ("i.i32", "I32", [3], struct.pack("<3i", -5, 0, 2**31 - 1)),
        ("b.bool", "BOOL", [5], bytes([1, 0, 0, 1, 1])),
        ("e.empty", "F32", [0, 4], b""),
        ("s.scalar", "F32", [], struct.pack("<f", 42.5)),
    ]
    header = {"__metadata__": {"format": "pt", "writer": "python-struct"}}
    data = b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)


if __name__ == "__main__":
    main(sys.argv[1])
