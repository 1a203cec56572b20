"""One trace from the ``--trace-file`` files of every process, as an indented waterfall.

    python -m ferry.infra.trace_view DIR_OR_FILE... [--trace-id ID | --request-id ID | --list]

A row per span, under its parent, children in start order: the service, the span's name, its
start after the trace's first span and its duration (ms), a bar on the trace's time line, and
its attributes; its events below it (``·``). Without an id: the trace that started last. A span
whose parent is in no file (a process killed before it exported it) is shown at the top level.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

Span = dict[str, Any]
BAR_WIDTH = 24
# the attributes every span of a request repeats, or that its row already says
QUIET = {"request_id"}


def read_spans(paths: Iterable[str | Path]) -> list[Span]:
    """Every span in the files (a directory: its *.jsonl); a line cut short by a killed
    process is skipped."""
    spans: list[Span] = []
    for given in paths:
        path = Path(given)
        for file in sorted(path.glob("*.jsonl")) if path.is_dir() else [path]:
            for line in file.read_text(errors="replace").splitlines():
                try:
                    spans.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return spans


def traces(spans: Iterable[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        out[s["trace_id"]].append(s)
    return dict(out)


def find(spans: list[Span], trace_id: str = "", request_id: str = "") -> list[Span]:
    """The spans of one trace: ``trace_id``'s, the one holding a span of ``request_id`` (a
    moved part's id, ``{request_id}.m1``, counts as it), or the one that started last."""
    by_trace = traces(spans)
    if trace_id:
        return by_trace.get(trace_id, [])
    if request_id:
        for ss in by_trace.values():
            if any(_is_request(s, request_id) for s in ss):
                return ss
        return []
    if not by_trace:
        return []
    return max(by_trace.values(), key=lambda ss: min(s["start_ns"] for s in ss))


def _is_request(span: Span, request_id: str) -> bool:
    rid = str(span.get("attributes", {}).get("request_id", ""))
    return rid == request_id or rid.startswith(f"{request_id}.")


def waterfall(spans: list[Span]) -> str:
    if not spans:
        return "no such trace in the files"
    t0 = min(s["start_ns"] for s in spans)
    total = max(max(s["end_ns"] for s in spans) - t0, 1)
    services = {s["service"] for s in spans}
    lines = [
        f"trace {spans[0]['trace_id']}: {len(spans)} spans, {len(services)} services, "
        f"{total / 1e6:.1f} ms",
        f"{'service':<16} {'span':<24} {'at ms':>8} {'ms':>8}  {'':<{BAR_WIDTH}}  attributes",
    ]
    ids = {s["span_id"] for s in spans}
    for depth, s in _tree(spans):
        start, dur = (s["start_ns"] - t0) / 1e6, (s["end_ns"] - s["start_ns"]) / 1e6
        name = "  " * depth + s["name"]
        bar = _bar(s["start_ns"] - t0, s["end_ns"] - t0, total)
        attrs = _attrs(s)
        if s["parent_span_id"] and s["parent_span_id"] not in ids:
            attrs += " (its parent is in no file)"
        lines.append(
            f"{s['service']:<16} {name:<24} {start:>8.1f} {dur:>8.1f}  {bar}  {attrs}".rstrip()
        )
        for e in s.get("events", ()):
            at = (e["time_ns"] - t0) / 1e6
            event = "  " * depth + f"  · {e['name']}"
            lines.append(
                f"{'':<16} {event:<24} {at:>8.1f} {'':>8}  {'':<{BAR_WIDTH}}  "
                f"{_fields(e.get('attributes', {}))}".rstrip()
            )
    return "\n".join(lines)


def _tree(spans: list[Span]) -> Iterator[tuple[int, Span]]:
    """(depth, span) depth first, children in start order; spans whose parent is in no file
    start a tree of their own."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        children[s["parent_span_id"] if s["parent_span_id"] in ids else ""].append(s)

    def walk(parent: str, depth: int) -> Iterator[tuple[int, Span]]:
        for s in sorted(children[parent], key=lambda s: s["start_ns"]):
            yield depth, s
            yield from walk(s["span_id"], depth + 1)

    return walk("", 0)


def _bar(start: int, end: int, total: int) -> str:
    a = min(BAR_WIDTH - 1, start * BAR_WIDTH // total)
    b = max(a + 1, -(-end * BAR_WIDTH // total))
    return " " * a + "█" * (b - a) + " " * (BAR_WIDTH - b)


def _attrs(span: Span) -> str:
    attrs = {k: v for k, v in span.get("attributes", {}).items() if k not in QUIET}
    status = span.get("status", {})
    if status.get("code") == "ERROR":
        attrs["error"] = status.get("description") or "yes"
    return _fields(attrs)


def _fields(attrs: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in attrs.items())


def _list(spans: list[Span]) -> str:
    """A line per trace, in start order: its id, span count, first span and request id."""
    rows = []
    for tid, ss in sorted(traces(spans).items(), key=lambda t: min(s["start_ns"] for s in t[1])):
        ids = {s["span_id"] for s in ss}
        root = min((s for s in ss if s["parent_span_id"] not in ids), key=lambda s: s["start_ns"])
        by_start = sorted(ss, key=lambda s: s["start_ns"])
        rid = next(
            (s["attributes"]["request_id"] for s in by_start if "request_id" in s["attributes"]), ""
        )
        rows.append(f"{tid}  {len(ss):>3} spans  {root['service']}/{root['name']}  {rid}".rstrip())
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ferry.infra.trace_view", description=__doc__, allow_abbrev=False
    )
    p.add_argument("files", nargs="+", help="--trace-file files, or directories of them")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--trace-id", default="", help="the trace to show (32 hex digits)")
    which.add_argument("--request-id", default="", help="the trace of this request")
    which.add_argument("--list", action="store_true", help="one line per trace in the files")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not Path(f).exists()]
    if missing:
        p.error(f"no such file or directory: {', '.join(missing)}")
    spans = read_spans(args.files)
    if args.list:
        print(_list(spans))
        return 0
    found = find(spans, args.trace_id, args.request_id)
    print(waterfall(found))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
