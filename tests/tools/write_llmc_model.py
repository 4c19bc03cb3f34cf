#!/usr/bin/env python3
"""An independent writer of llm.c's GPT-2 model files (standard library only).

llm.c's train_gpt2.py (write_model) writes a header of 256 little-endian
int32 (magic 20240326, version 3 for float32 parameters, max_seq_len,
vocab_size, num_layers, num_heads, channels, padded_vocab_size), then wte
(Vp, C) with its rows past the vocabulary zero, wpe (maxT, C), and per layer,
stacked: ln1w, ln1b, qkvw (3C, C), qkvb, attprojw (C, C), attprojb, ln2w,
ln2b, fcw (4C, C), fcb, fcprojw (C, 4C), fcprojb; then lnfw, lnfb. Weights
are nn.Linear's [out, in].

usage: write_llmc_model.py HF_GPT2_FOLDER OUT.bin

reads a Hugging Face GPT-2 folder (config.json, model.safetensors in float32),
whose Conv1D weights are [in, out] and so are transposed here.
"""
import json
import struct
import sys

folder, out = sys.argv[1], sys.argv[2]
config = json.load(open(folder + "/config.json"))
raw = open(folder + "/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]


def floats(name):
    entry = header[name]
    assert entry["dtype"] == "F32", (name, entry["dtype"])
    begin, end = entry["data_offsets"]
    return list(struct.unpack("<%df" % ((end - begin) // 4), data[begin:end])), entry["shape"]


def transposed(values, shape):
    rows, cols = shape
    return [values[r * cols + c] for c in range(cols) for r in range(rows)]


L, C, V, T, NH = config["n_layer"], config["n_embd"], config["vocab_size"], config["n_positions"], config["n_head"]
Vp = (V + 127) // 128 * 128
params = []
wte, _ = floats("transformer.wte.weight")
params += wte + [0.0] * ((Vp - V) * C)
params += floats("transformer.wpe.weight")[0]
conv1d = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
for suffix in ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
               "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
               "mlp.c_proj.weight", "mlp.c_proj.bias"]:
    for l in range(L):
        values, shape = floats("transformer.h.%d.%s" % (l, suffix))
        params += transposed(values, shape) if suffix in conv1d else values
params += floats("transformer.ln_f.weight")[0] + floats("transformer.ln_f.bias")[0]
head = [20240326, 3, T, V, L, NH, C, Vp] + [0] * 248
with open(out, "wb") as f:
    f.write(struct.pack("<256i", *head))
    f.write(struct.pack("<%df" % len(params), *params))
print(out, "written:", len(params), "parameters")
