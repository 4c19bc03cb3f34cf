#!/usr/bin/env python3
"""Runs the commands of README.md and docs/*.md as written: every ```sh block,
in order, one bash session per document (so a block's variables, T and MPI,
reach the next), in a scratch folder that holds links to the checkout's files
and to its build/, so the documents' relative paths work and what the
commands write stays out of the checkout.

A comment on the line before a block changes how it runs:
    <!-- walk: skip: WHY -->          not run (the report prints WHY)
    <!-- walk: shorten ARGS -->       ARGS added after each tessera-train word
                                      (flags win wherever they stand); the
                                      document says the run may be shortened
    <!-- walk: fails: WHY -->         the block is meant to end in an error:
                                      run without stopping at one

    tests/docs/walk_docs.py [--build build] [--only README.md,docs/labs.md] [--keep DIR]

Prints each document's blocks run and skipped, its time, and the end of its
log where a command failed; exits 1 if any document failed. Run from the
checkout after `make test` (or `meson compile -C build`). HOME is the scratch
folder's, so the README's install prefix ($HOME/tessera) lands there, and the
build's prefix is set back afterwards.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

MARK = re.compile(r"^<!-- walk: (skip|shorten|fails)(?::)?\s*(.*?)\s*-->$")


def blocks_of(path):
    """The document's ```sh blocks: (line, mode, argument, text)."""
    lines = open(path).read().split("\n")
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            mode, arg = "run", ""
            m = MARK.match(lines[i - 1].strip()) if i > 0 else None
            if m:
                mode, arg = m.group(1), m.group(2)
            out.append((i + 1, mode, arg, "\n".join(lines[i + 1:j])))
            i = j + 1
        else:
            i += 1
    return out


def shorten(text, args):
    # Joined continuation lines keep their backslashes; the args go right
    # after the program's name, before its own flags.
    return re.sub(r"(tessera-train)(?=\s|$)", r"\1 " + args, text)


def script_of(doc, blocks):
    parts = ["set -e"]
    for line, mode, arg, text in blocks:
        if mode == "skip":
            continue
        parts.append('echo "== %s:%d"' % (doc, line))
        if mode == "shorten":
            text = shorten(text, arg)
        if mode == "fails":
            parts += ["set +e", text, "set -e"]
        else:
            parts.append(text)
    parts.append('echo "== %s: done"' % doc)
    return "\n".join(parts) + "\n"


def scratch_for(repo, build, root, doc):
    here = os.path.join(root, doc.replace("/", "_").replace(".md", ""))
    os.makedirs(os.path.join(here, "home"))
    for name in os.listdir(repo):
        if name in (".git", "out", "data") or name.startswith("build"):
            continue
        os.symlink(os.path.join(repo, name), os.path.join(here, name))
    os.symlink(build, os.path.join(here, "build"))
    return here


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--only", default="", help="comma-separated documents (default: all)")
    ap.add_argument("--keep", default="", help="scratch folder to keep (default: a temporary one, removed)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per document")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    build = os.path.abspath(args.build)
    if not os.path.exists(os.path.join(build, "tools", "tessera-train")):
        sys.exit("walk_docs: no %s/tools/tessera-train: build first (make test, or meson compile -C build)" % build)
    docs = ["README.md"] + sorted(os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, "docs", "*.md")))
    if args.only:
        want = args.only.split(",")
        docs = [d for d in docs if d in want]
    root = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="walk_docs.")
    os.makedirs(root, exist_ok=True)
    prefix = subprocess.run(["meson", "introspect", "--buildoptions", build], capture_output=True, text=True).stdout
    m = re.search(r'"name": "prefix", "value": "([^"]*)"', prefix)
    failed = []
    try:
        for doc in docs:
            blocks = blocks_of(os.path.join(repo, doc))
            if not blocks:
                continue
            here = scratch_for(repo, build, root, doc)
            script = os.path.join(here, "walk.sh")
            with open(script, "w") as f:
                f.write(script_of(doc, blocks))
            log = os.path.join(here, "walk.log")
            env = dict(os.environ, HOME=os.path.join(here, "home"))
            start = time.time()
            with open(log, "w") as out:
                try:
                    rc = subprocess.run(["bash", script], cwd=here, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            took = time.time() - start
            ran = sum(1 for b in blocks if b[1] != "skip")
            print("%-26s %2d block(s) run, %d skipped, %6.1f s: %s" %
                  (doc, ran, len(blocks) - ran, took, "ok" if rc == 0 else "FAILED (%s)" % rc))
            for line, mode, arg, _ in blocks:
                if mode != "run":
                    print("    line %d: %s%s" % (line, mode, ": " + arg if arg else ""))
            if rc != 0:
                failed.append(doc)
                tail = open(log).read().split("\n")[-30:]
                print("    " + "\n    ".join(tail))
            sys.stdout.flush()
    finally:
        if m:  # the README's embedding section sets the build's prefix: set it back
            subprocess.run(["meson", "configure", build, "--prefix", m.group(1)], capture_output=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("walk_docs: %d document(s) failed: %s" % (len(failed), ", ".join(failed)) if failed
          else "walk_docs: every command ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
