"""Result documents: medians and ratios (``summarize``), a schema check (``validate``), Markdown.

A result document (one suite at one size, ``bench/results/<suite>-<size>.json``)::

    {"schema": "ckptbridge-bench/1", "suite", "title", "description", "size", "gib", "params", "reps",
     "started", "finished", "commit", "prepare_s", "machine": {...machine.py facts...},
     "columns": [{"key", "header", "fmt"}],
     "cases": [{"name", "group", "tool", "settings", "role", "ref", "kind", "startup", "note",
                "is_startup_probe", "mem_needed_bytes", "status": "ok"|"skipped"|"error", "reason",
                "runs": [{<measure.Measurement fields>, "metrics": {...}}], "median": {...},
                "cold": {<one more run, the inputs evicted first>}}],
     "groups": [{"group", "ref", "rows": [{"case", "wall_s", "startup_s", "net_s", "time_vs_ref",
                 "net_vs_ref"}], "peers": [{"tool", "default", "fastest", "speedup_default",
                 "speedup_fastest", "net_speedup_default", "net_speedup_fastest",
                 "mem_ratio_default", "storage_read_ratio_default"}]}]}

``speedup_*`` = the peer's time / ckptbridge's (reference case of the group): > 1 means
ckptbridge is faster. ``net_*`` subtract each command's start-up probe (same measurement).
``mem_ratio`` (tree PSS above base) / ``storage_read_ratio`` (bytes read from storage in the run with the
inputs evicted from the page cache) = ckptbridge's / the peer's (< 1: less). Each case's ``cold`` holds
that extra run (``evicted_bytes``: what was evicted).
"""

from __future__ import annotations

import statistics
from typing import Any

from .measure import Measurement

NUMERIC = [f for f in Measurement.__dataclass_fields__ if f not in ("returncode",)]
CASE_KEYS = ("name", "group", "tool", "settings", "role", "ref", "kind", "startup", "status", "runs")
TOP_KEYS = ("schema", "suite", "title", "size", "gib", "reps", "started", "commit", "machine", "cases", "groups")
MACHINE_KEYS = ("cores", "mem_total_bytes", "memcpy_gbps", "disk_write_gbps", "disk_read_gbps")
MIB = 2**20


def _median(values: list[Any]) -> Any:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Fill each case's ``median`` and the per-group ``groups`` comparisons."""
    by_name = {c["name"]: c for c in doc["cases"]}
    for c in doc["cases"]:
        runs = [r for r in c["runs"] if "error" not in r]
        med = {k: _median([r.get(k) for r in runs]) for k in NUMERIC}
        keys = sorted({k for r in runs for k in r.get("metrics", {})})
        med.update({f"m.{k}": _median([r["metrics"].get(k) for r in runs]) for k in keys})
        c["median"] = med if runs else {}

    def ok(c: dict[str, Any] | None) -> bool:
        return bool(c) and c["status"] == "ok" and c["median"].get("wall_s") is not None

    def startup_s(c: dict[str, Any]) -> float | None:
        p = by_name.get(f"startup/{c['startup']}") if c.get("startup") else None
        p = p or next((x for x in doc["cases"] if x["is_startup_probe"] and c.get("startup")
                       and x["name"].endswith(c["startup"])), None)
        return p["median"]["wall_s"] if ok(p) else None

    groups = []
    for g in dict.fromkeys(c["group"] for c in doc["cases"] if not c["is_startup_probe"]):
        members = [c for c in doc["cases"] if c["group"] == g and not c["is_startup_probe"]]
        ref = next((c for c in members if c["ref"] and ok(c)), None) or \
            next((c for c in members if c["role"] == "ours" and ok(c)), None)
        rows = []
        for c in members:
            if not ok(c):
                rows.append({"case": c["name"], "wall_s": None})
                continue
            w, s = c["median"]["wall_s"], startup_s(c)
            net = _net_of(c, w, s)
            row = {"case": c["name"], "wall_s": w, "startup_s": s, "net_s": net}
            if ref is not None:
                rw, rs = ref["median"]["wall_s"], startup_s(ref)
                rnet = _net_of(ref, rw, rs)
                row["time_vs_ref"] = w / rw if rw else None
                row["net_vs_ref"] = net / rnet if net is not None and rnet else None
            rows.append(row)
        peers = []
        if ref is not None:
            row_of = {r["case"]: r for r in rows}

            def ours(peer: dict[str, Any], g: str = g, ref: dict[str, Any] = ref) -> dict[str, Any]:
                """The ckptbridge case a peer case is compared with: its ``vs`` (same input), else the ref."""
                c = by_name.get(peer.get("vs") or "")
                return c if c is not None and c["group"] == g and ok(c) else ref

            for tool in dict.fromkeys(c["tool"] for c in members if c["role"] == "peer"):
                mine = [c for c in members if c["tool"] == tool and c["role"] == "peer" and ok(c)]
                if not mine:
                    continue
                default = next((c for c in mine if c["settings"].startswith("default")), mine[0])
                fastest = min(mine, key=lambda c: c["median"]["wall_s"])
                drow, frow = row_of[default["name"]], row_of[fastest["name"]]
                dref, fref = ours(default), ours(fastest)
                drr, frr = row_of[dref["name"]], row_of[fref["name"]]
                peers.append({
                    "tool": tool, "default": default["name"], "fastest": fastest["name"],
                    "vs_default": dref["name"], "vs_fastest": fref["name"],
                    "speedup_default": drow["wall_s"] / drr["wall_s"],
                    "speedup_fastest": frow["wall_s"] / frr["wall_s"],
                    "net_speedup_default": _ratio(drow["net_s"], drr["net_s"]),
                    "net_speedup_fastest": _ratio(frow["net_s"], frr["net_s"]),
                    "mem_ratio_default": _ratio(dref["median"]["pss_above_base"], default["median"]["pss_above_base"]),
                    "storage_read_ratio_default": _ratio((dref.get("cold") or {}).get("read_bytes"),
                                                         (default.get("cold") or {}).get("read_bytes")),
                })
        sums = [c["median"].get("m.checksum") for c in members if ok(c)]
        sums = [x for x in sums if isinstance(x, (int, float))]
        agree = None if len(sums) < 2 else all(abs(x - sums[0]) <= 1e-6 * max(1.0, abs(sums[0])) for x in sums)
        groups.append({"group": g, "ref": ref["name"] if ref else None, "rows": rows, "peers": peers,
                       "checksums_agree": agree})
    doc["groups"] = groups
    return doc


def _net_of(c: dict[str, Any], wall: float, startup: float | None) -> float | None:
    """Time without start-up: command lines include theirs (None when noise made it larger);
    in-process cases start their clock after it."""
    if c["kind"] != "cmd" or startup is None:
        return wall
    return wall - startup if wall > startup else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def validate(doc: dict[str, Any]) -> list[str]:
    """Problems with a result document (empty when it has the schema's shape)."""
    errs = [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in doc]
    if doc.get("schema") != "ckptbridge-bench/1":
        errs.append(f"schema {doc.get('schema')!r}")
    m = doc.get("machine") or {}
    errs += [f"machine facts lack {k!r}" for k in MACHINE_KEYS if not isinstance(m.get(k), (int, float))]
    for c in doc.get("cases", []):
        errs += [f"case {c.get('name')}: missing {k!r}" for k in CASE_KEYS if k not in c]
        if c.get("status") not in ("ok", "skipped", "error"):
            errs.append(f"case {c.get('name')}: status {c.get('status')!r}")
        if c.get("status") == "ok":
            if not c.get("runs"):
                errs.append(f"case {c.get('name')}: ok without runs")
            for r in c.get("runs", []):
                for k in NUMERIC:
                    v = r.get(k)
                    if not isinstance(v, (int, float)) or v < 0:
                        errs.append(f"case {c['name']}: run field {k!r} = {v!r}")
        elif not c.get("reason"):
            errs.append(f"case {c.get('name')}: {c.get('status')} without a reason")
    for g in doc.get("groups", []):
        for k in ("group", "ref", "rows", "peers"):
            if k not in g:
                errs.append(f"group {g.get('group')}: missing {k!r}")
    return errs


# ------------------------------------------------------------------------------------------ Markdown

def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def _mib(v: Any) -> str:
    return "—" if v is None else f"{v / MIB:.0f}"


def machine_line(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    if not m:
        return ""
    la = m.get("loadavg") or [None]
    return (f"Machine (measured in this run): {m.get('cores')} cores, {_f((m.get('mem_total_bytes') or 0) / 2**30, '{:.0f}')} GiB "
            f"({_f((m.get('mem_available_bytes') or 0) / 2**30, '{:.0f}')} GiB available), load average "
            f"{_f(la[0])} at the start; one memcpy {_f(m.get('memcpy_gbps'))} GB/s, fresh memory "
            f"{_f(m.get('fresh_memory_gbps'))} GB/s, disk write {_f(m.get('disk_write_gbps'))} GB/s, disk read "
            f"(O_DIRECT) {_f(m.get('disk_read_gbps'))} GB/s.")


def _net(row: dict[str, Any], kind: str) -> str:
    if row.get("startup_s") is None or kind != "cmd":
        return "—"
    if row.get("net_s") is None:
        return "< start-up (noise)"
    return f"{row['net_s']:.3f}"


def group_table(doc: dict[str, Any], g: dict[str, Any], compact: bool = False) -> list[str]:
    """One group's table; ``compact`` (the README's) leaves out the largest process, ``rchar`` and
    the sampled mapped bytes (all in the result file and its .md)."""
    cases = {c["name"]: c for c in doc["cases"]}
    cols = doc.get("columns") or []
    cold = doc.get("cold_inputs_run")
    head = ["tool", "settings", "time s", "start-up s", "time − start-up s", "time / ckptbridge's",
            "peak memory above base, tree PSS MiB"]
    if not compact:
        head += ["largest process RSS (whole run) MiB", "read calls (rchar) MiB", "mapped (sampled, a lower bound) MiB"]
    if cold:
        head += ["inputs evicted: time s", "inputs evicted: read from storage MiB"]
    head += [c["header"] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in g["rows"]:
        c = cases[row["case"]]
        name = c["tool"] + (" (ref)" if c["name"] == g["ref"] else "")
        if row["wall_s"] is None:
            why = (c.get("reason") or "no result").splitlines()[0][:200]
            lines.append(f"| {name} | {c['settings']} | {c['status']}: {why} |" + " |" * (len(head) - 3))
            continue
        med = c["median"]
        ratio = _f(row.get("time_vs_ref"))
        if c["kind"] == "cmd" and row.get("startup_s") is not None and row.get("net_vs_ref") is not None:
            ratio += f" (net {_f(row['net_vs_ref'])})"
        cells = [name, c["settings"], _f(row["wall_s"], "{:.3f}"), _f(row.get("startup_s"), "{:.3f}"),
                 _net(row, c["kind"]), ratio, _mib(med.get("pss_above_base"))]
        if not compact:
            cells += [_mib(med.get("maxrss")), _mib(med.get("rchar")), _mib(med.get("mapped"))]
        if cold:
            cells += [_f((c.get("cold") or {}).get("wall_s"), "{:.3f}"), _mib((c.get("cold") or {}).get("read_bytes"))]
        cells += [_f(med.get(f"m.{col['key']}"), col["fmt"]) for col in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _speed(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"


def peer_lines(doc: dict[str, Any], g: dict[str, Any]) -> list[str]:
    cases = {c["name"]: c for c in doc["cases"]}
    out = []
    for p in g["peers"]:
        d, f = cases[p["default"]], cases[p["fastest"]]
        dvs, fvs = p.get("vs_default", g["ref"]), p.get("vs_fastest", g["ref"])
        s = (f"- ckptbridge ({cases[dvs]['settings']}) vs {p['tool']} at its default settings: "
             f"{_speed(p['speedup_default'])}")
        if p.get("net_speedup_default") is not None and p["net_speedup_default"] != p["speedup_default"]:
            s += f" ({_speed(p['net_speedup_default'])} net of start-up)"
        if p["fastest"] != p["default"]:
            against = f", against ckptbridge's {cases[fvs]['settings']}" if fvs != dvs else ""
            s += f"; vs its fastest settings here ({f['settings']}{against}): {_speed(p['speedup_fastest'])}"
            if p.get("net_speedup_fastest") is not None and p["net_speedup_fastest"] != p["speedup_fastest"]:
                s += f" ({_speed(p['net_speedup_fastest'])} net)"
        rc = cases[dvs]
        ref = rc["median"]
        s += f". Peak memory above base {_mib(ref.get('pss_above_base'))} vs {_mib(d['median'].get('pss_above_base'))} MiB"
        if rc.get("cold") and d.get("cold"):
            s += (f"; read from storage (inputs evicted) {_mib(rc['cold']['read_bytes'])} vs "
                  f"{_mib(d['cold']['read_bytes'])} MiB")
        s += "."
        out.append(s)
    return out


def _agree(g: dict[str, Any]) -> list[str]:
    if g.get("checksums_agree") is None:
        return []
    return ["- Every tool loaded the same values (sums agree)." if g["checksums_agree"]
            else "- **The tools' sums of the values loaded differ.**"]


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# {doc['title']} — size `{doc['size']}` ({doc['gib']} GiB)", ""]
    if doc.get("description"):
        lines += [doc["description"].strip(), ""]
    lines += [f"Run {doc['started']} at commit {doc.get('commit')}, medians of {doc['reps']} rep(s), each a fresh "
              "process; time = wall clock of the timed region (harness clock, same for every tool). "
              "Ratios > 1 in *time / ckptbridge's* mean ckptbridge is faster.", "", machine_line(doc), ""]
    for g in doc["groups"]:
        lines += [f"## {g['group']}", "", *group_table(doc, g), "", *peer_lines(doc, g), *_agree(g), ""]
    probes = [c for c in doc["cases"] if c["is_startup_probe"]]
    if probes:
        lines += ["## start-up (each tool's process start and imports, measured the same way)", "",
                  "| probe | time s | peak memory above base, tree PSS MiB | read calls (rchar) MiB |", "|---|---|---|---|"]
        for c in probes:
            med = c.get("median") or {}
            lines.append(f"| {c['tool']} ({c['settings']}) | {_f(med.get('wall_s'), '{:.3f}')} | "
                         f"{_mib(med.get('pss_above_base'))} | {_mib(med.get('rchar'))} |")
        lines.append("")
    notes = [f"- {c['tool']} ({c['settings']}): {c['note']}" for c in doc["cases"] if c.get("note")]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    return "\n".join(lines)


def readme_block(doc: dict[str, Any]) -> str:
    """The README's table for one result file (the same tables, shorter header)."""
    lines = [f"*{doc['title']}*, {doc['gib']} GiB, medians of {doc['reps']}, run {doc['started'][:10]} "
             f"(`bench/results/{doc['suite']}-{doc['size']}.json`). {machine_line(doc)}", ""]
    for g in doc["groups"]:
        lines += [f"**{g['group']}**", "", *group_table(doc, g), "", *peer_lines(doc, g), *_agree(g), ""]
    return "\n".join(lines).rstrip() + "\n"
