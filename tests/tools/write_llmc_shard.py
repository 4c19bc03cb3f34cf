#!/usr/bin/env python3
"""An independent writer of llm.c token shards (standard library only: struct).

llm.c's dev/data scripts (write_datafile in dev/data/data_common.py) write a
header of 256 little-endian int32 (magic, version, token count, then zeros)
followed by the tokens: GPT-2 shards are magic 20240520, version 1, uint16
tokens; Llama-3 shards are magic 20240801, version 7, uint32 tokens.

usage: write_llmc_shard.py OUT KIND TEXT_FILE

The tokens are the bytes of TEXT_FILE (byte tokens, valid GPT-2 token ids).
KIND is one of:
  gpt2         a valid GPT-2 shard
  gpt2-eot     a valid GPT-2 shard whose documents (lines) each begin with
               <|endoftext|> (50256), as llm.c's fineweb/tinystories scripts do
  bad-magic    magic 20240521
  bad-version  version 2
  llama3       llm.c's Llama-3 format (magic 20240801, version 7, uint32 tokens)
  truncated    the header promises more tokens than the file holds
  short        only part of the header
  trailing     two bytes after the tokens the header promises
  huge-claim   the header promises 2^31 - 1 tokens (4 GiB), the file holds the text's
"""
import struct
import sys

GPT2_MAGIC, GPT2_VERSION = 20240520, 1
LLAMA3_MAGIC, LLAMA3_VERSION = 20240801, 7
EOT = 50256


def header(magic, version, count):
    h = [0] * 256
    h[0], h[1], h[2] = magic, version, count
    return struct.pack("<256i", *h)


def main(out, kind, text_file):
    tokens = list(open(text_file, "rb").read())
    if kind == "gpt2-eot":
        lines = open(text_file, "rb").read().split(b"\n")
        tokens = [t for line in lines for t in [EOT] + list(line + b"\n")]
    u16 = lambda ts: struct.pack("<%dH" % len(ts), *ts)
    n = len(tokens)
    if kind in ("gpt2", "gpt2-eot"):
        data = header(GPT2_MAGIC, GPT2_VERSION, n) + u16(tokens)
    elif kind == "bad-magic":
        data = header(GPT2_MAGIC + 1, GPT2_VERSION, n) + u16(tokens)
    elif kind == "bad-version":
        data = header(GPT2_MAGIC, 2, n) + u16(tokens)
    elif kind == "llama3":
        data = header(LLAMA3_MAGIC, LLAMA3_VERSION, n) + struct.pack("<%dI" % n, *tokens)
    elif kind == "truncated":
        data = header(GPT2_MAGIC, GPT2_VERSION, n) + u16(tokens[: n // 2])
    elif kind == "huge-claim":
        data = header(GPT2_MAGIC, GPT2_VERSION, 2**31 - 1) + u16(tokens)
    elif kind == "short":
        data = header(GPT2_MAGIC, GPT2_VERSION, n)[:600]
    elif kind == "trailing":
        data = header(GPT2_MAGIC, GPT2_VERSION, n) + u16(tokens) + b"\0\0"
    else:
        sys.exit("unknown kind %r" % kind)
    with open(out, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
