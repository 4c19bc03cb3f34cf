#!/usr/bin/env python3
"""Draws a Tessera trace (Chrome/Perfetto JSON, as tessera-train's
--profiling.trace_steps writes it) as a PNG timeline, with gnuplot.

One band per rank; in each, one lane per kind of work the trace records:
compute (forward and backward ops in two colours), a pipeline's F and B
actions and its bubble, context parallelism's attention blocks and K/V
exchanges, expert parallelism's phases (dispatch, the local experts,
combine, and the exchanges' backwards) and its all-to-alls, each collective kind (and point-to-point messages) on
its own lane (the time the communication thread spends in it), the compute
stream waiting for communication (exposed communication), FSDP's copies
in and out of its buffers, and the bytes the rank holds in tensors (the
trace's memory counter: rising at each unshard, falling at each reshard),
scaled to the largest rank's peak. A time axis in milliseconds from the
window's start, and a legend.

    tools/trace_png.py TRACE.json OUT.png [--title T] [--window FROM_MS TO_MS]
                       [--gathers FROM TO] [--ranks 0,1] [--width PIXELS]

--window zooms on part of the trace (milliseconds from its first event),
e.g. one block's forward; events are clipped to it. --gathers zooms from the
start of rank 0's FROM-th all-gather (counting from 1) to the start of its
TO-th, which picks the same part of a step on any machine (with sequence
parallelism a block's forward is two all-gathers: --gathers 3 5 is the
second block's). The title is the run, step, ranks and settings tessera-train
wrote into the trace (its otherData), else the file's name. Needs python3 and
gnuplot (the README's install line brings both); prints why it cannot draw
and exits 1 otherwise.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Lanes in the order drawn (top to bottom within a rank), by the trace's
# thread names, with the label shown.
LANES = [
    ("pipeline", "pipeline F / B"),
    ("pipeline bubble", "pipeline bubble"),
    ("compute", "compute"),
    ("context parallel attention", "CP attention"),
    ("context parallel K/V", "CP K/V exchange"),
    ("expert parallel", "EP dispatch / combine"),
    ("expert parallel all-to-all", "EP all-to-all"),
    ("all_gather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("all_reduce", "all-reduce"),
    ("other collectives", "other collectives"),
    ("send_recv", "send / recv"),
    ("waiting for communication (exposed)", "waiting (exposed)"),
    ("fsdp", "FSDP copies"),
    ("memory", "memory"),
]
# Series drawn (each its own colour and legend entry): name, colour.
SERIES = [
    ("forward / other compute", "#4c72b0"),
    ("backward compute", "#dd8452"),
    ("all-gather", "#55a868"),
    ("reduce-scatter", "#8172b3"),
    ("all-reduce", "#937860"),
    ("other collectives, send / recv", "#8c8c8c"),
    ("waiting for communication (exposed)", "#c44e52"),
    ("FSDP copy-in / copy-out", "#64b5cd"),
    ("pipeline bubble (idle)", "#f0c040"),
    ("MoE dispatch / combine", "#da8bc3"),
]


def series_of(lane, name):
    if lane == "compute":
        return 1 if name.endswith(".backward") else 0
    if lane == "pipeline":  # F<stage>.<micro-batch> / B<stage>.<micro-batch>
        return 1 if name.startswith("B") else 0
    if lane == "context parallel attention":  # "attention (diagonal)", "attention backward", ...
        return 1 if name.startswith("attention backward") else 0
    if lane == "context parallel K/V":  # the cp group's collectives and messages: "all_gather #3 (cp)"
        return 2 if name.startswith("all_gather") else 3 if name.startswith("reduce_scatter") else 5
    if lane == "expert parallel":  # "dispatch", "experts", "combine", "combine backward", ...
        return 0 if name == "experts" else 9
    if lane == "expert parallel all-to-all":  # "all_to_all #5 (ep)", "all_to_all_single #6 (ep)"
        return 5
    return {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 4, "other collectives": 5, "send_recv": 5,
            "waiting for communication (exposed)": 6, "fsdp": 7, "pipeline bubble": 8}.get(lane)


def gnuplot_title(title, width):
    """The title as a gnuplot string, broken after a comma onto a second line
    where it would not fit the picture's width (about 12 pixels a character, with the margins)."""
    fits = max(40, width // 12)
    if len(title) > fits and ", " in title:
        cut = title.rfind(", ", 0, fits)
        cut = cut if cut > 0 else title.find(", ")
        title = title[:cut + 1] + "\n" + title[cut + 2:]
    return '"%s"' % title.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def fail(message):
    print("trace_png: " + message, file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--title", default=None)
    ap.add_argument("--window", nargs=2, type=float, metavar=("FROM_MS", "TO_MS"))
    ap.add_argument("--gathers", nargs=2, type=int, metavar=("FROM", "TO"))
    ap.add_argument("--ranks", default=None, help="comma-separated ranks to draw (default: all)")
    ap.add_argument("--width", type=int, default=1600)
    args = ap.parse_args()

    if shutil.which("gnuplot") is None:
        fail("gnuplot is not installed (apt-get install gnuplot-nox)")
    try:
        with open(args.trace) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        fail("cannot read %s: %s" % (args.trace, e))
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        fail("%s has no traceEvents list" % args.trace)

    lane_names = {}  # (pid, tid) -> thread name
    rank_names = {}  # pid -> process name
    spans = []
    samples = {}  # pid -> [(ts, MiB)]: the memory counter
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lane_names[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            rank_names[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "X" and "ts" in e and "dur" in e:
            spans.append(e)
        elif e.get("ph") == "C" and str(e.get("name", "")).startswith("memory") and "ts" in e:
            samples.setdefault(e.get("pid"), []).append((float(e["ts"]), float(e.get("args", {}).get("MiB", 0))))
    if not spans:
        fail("%s holds no timed events (ph X)" % args.trace)
    t0 = min(float(e["ts"]) for e in spans)
    lo, hi = (args.window if args.window else (0.0, max(float(e["ts"]) + float(e["dur"]) - t0 for e in spans) / 1e3))
    if args.gathers:
        first = min(e.get("pid") for e in spans)
        starts = sorted((float(e["ts"]) - t0) / 1e3 for e in spans
                        if e.get("pid") == first and lane_names.get((e.get("pid"), e.get("tid"))) == "all_gather")
        a, b = args.gathers
        if not 1 <= a < b:
            fail("--gathers %d %d: expected 1 <= FROM < TO" % (a, b))
        if b > len(starts):
            fail("--gathers %d %d: rank %s has %d all-gather(s) in the trace" % (a, b, first, len(starts)))
        lo, hi = starts[a - 1], starts[b - 1]
    if not hi > lo:
        fail("empty window: %g to %g ms" % (lo, hi))
    ranks = sorted({e.get("pid") for e in spans})
    if args.ranks:
        want = {int(r) for r in args.ranks.split(",")}
        missing = want - set(ranks)
        if missing:
            fail("the trace has ranks %s, not %s" % (ranks, sorted(missing)))
        ranks = [r for r in ranks if r in want]

    # Lanes with any event in the window, in LANES order, the same for every rank.
    used = set()
    clipped = []
    for e in spans:
        if e.get("pid") not in ranks:
            continue
        lane = lane_names.get((e.get("pid"), e.get("tid")), "")
        start = (float(e["ts"]) - t0) / 1e3
        end = start + float(e["dur"]) / 1e3
        start, end = max(start, lo), min(end, hi)
        if end <= start and not (start == end and lo <= start <= hi):
            continue
        s = series_of(lane, str(e.get("name", "")))
        if s is None:
            continue
        used.add(lane)
        clipped.append((e.get("pid"), lane, s, start, end))
    # The memory counter inside the window (and the value it had on entering it).
    memory = {}
    for pid, pts in samples.items():
        if pid not in ranks:
            continue
        pts.sort()
        inside = [((ts - t0) / 1e3, v) for ts, v in pts if lo <= (ts - t0) / 1e3 <= hi]
        before = [v for ts, v in pts if (ts - t0) / 1e3 < lo]
        if before:
            inside.insert(0, (lo, before[-1]))
        if inside:
            inside.append((hi, inside[-1][1]))
            memory[pid] = inside
    if memory:
        used.add("memory")
    peak = max((v for pts in memory.values() for _, v in pts), default=0.0) or 1.0
    lanes = [(n, label if n != "memory" else "memory (0-%.0f MiB)" % peak) for n, label in LANES if n in used]
    if not lanes:
        fail("no events in the window %g-%g ms" % (lo, hi))

    # y: each rank a band of len(lanes) rows and a gap; rank 0 on top.
    rows = len(lanes)
    lane_row = {n: i for i, (n, _) in enumerate(lanes)}
    band = rows + 1

    def y_of(rank_index, lane):
        return (len(ranks) - 1 - rank_index) * band + (rows - 1 - lane_row[lane]) + 0.5

    min_half = (hi - lo) / args.width / 2  # at least one pixel wide
    work = tempfile.mkdtemp(prefix="trace_png.")
    try:
        files = []
        for s in range(len(SERIES)):
            path = os.path.join(work, "s%d.dat" % s)
            with open(path, "w") as f:
                for pid, lane, si, start, end in clipped:
                    if si != s:
                        continue
                    half = max((end - start) / 2, min_half)
                    f.write("%.6f %.3f %.6f 0.38\n" % ((start + end) / 2, y_of(ranks.index(pid), lane), half))
            files.append(path)
        mem_path = os.path.join(work, "memory.dat")
        with open(mem_path, "w") as f:
            for pid, pts in memory.items():
                base = y_of(ranks.index(pid), "memory") - 0.4
                for t, v in pts:
                    f.write("%.6f %.4f\n" % (t, base + 0.8 * v / peak))
                f.write("\n\n")
        tics = []
        for ri, r in enumerate(ranks):
            for n, label in lanes:
                text = "%s  %s" % (rank_names.get(r, "rank %s" % r), label) if n == lanes[0][0] else label
                tics.append('"%s" %.3f' % (text.replace('"', "'"), y_of(ri, n)))
        height = 140 + 26 * band * len(ranks)
        other = data.get("otherData", {}) if isinstance(data, dict) else {}
        written = other.get("title") if isinstance(other, dict) else None
        title = args.title if args.title is not None else (str(written) if written else os.path.basename(args.trace))
        script = [
            "set terminal pngcairo size %d,%d font 'Sans,11'" % (args.width, max(height, 320)),
            "set output '%s'" % args.png.replace("'", "''"),
            "set title %s font 'Sans,13' noenhanced" % gnuplot_title(title, args.width),
            "set xlabel 'time (ms)'",
            "set xrange [%g:%g]" % (lo, hi),
            "set yrange [-0.5:%g]" % (band * len(ranks) - 1.0),
            "set ytics (%s) nomirror" % ", ".join(tics),
            "set grid xtics lc rgb '#dddddd'",
            "set bmargin 7",
            "set key at screen 0.5, screen 0.015 center bottom horizontal maxrows 2 width 2",
            "set style fill solid 1.0 noborder",
            "set lmargin 30",
        ]
        plots = []
        for s, (name, colour) in enumerate(SERIES):
            if os.path.getsize(files[s]) == 0:
                continue
            plots.append("'%s' using 1:2:3:4 with boxxyerror lc rgb '%s' title '%s'" % (files[s], colour, name))
        if memory:
            plots.append("'%s' using 1:2 with steps lw 2 lc rgb '#222222' title 'memory allocated in tensors'"
                         % mem_path)
        script.append("plot " + ", \\\n     ".join(plots))
        gp = os.path.join(work, "plot.gp")
        with open(gp, "w") as f:
            f.write("\n".join(script) + "\n")
        r = subprocess.run(["gnuplot", gp], capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(args.png):
            fail("gnuplot failed: " + r.stderr.strip()[-500:])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("%s: %d rank(s), %d lane(s), %.1f-%.1f ms, %d events" % (args.png, len(ranks), rows, lo, hi, len(clipped)))


if __name__ == "__main__":
    main()
