"""Turn every rank's outcome into one pytest outcome and a readable report.

Rules (every rank counts):

- all ranks passed -> passed;
- all ranks skipped (pytest.skip) -> skipped with the reason (grouped by rank when reasons differ);
- all ranks xfailed -> xfailed;
- anything else -> failed, with one section per *distinct* failure ("ranks 0-3: AssertionError: ..."
  shows the traceback once), dead ranks ("rank 2 was killed by SIGKILL (signal 9)"), disagreeing
  skips, and, for ranks that were stuck (deadline, or straggling after a peer failed), where each
  one waited plus its faulthandler stack. A dead rank is the cause: it comes first in the headline
  and the report, its peers' errors (gloo's "Connection reset by peer") after it, shortened in the
  headline.

The failure is raised in the parent as :class:`RankFailure`; ``hooks.py`` turns it into a
:class:`TPLongRepr` so the terminal, ``-rf`` summary lines, junitxml and xdist all show the grouped
text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .pool import PoolRun
from .protocol import STRAGGLER_GRACE_S, RankOutcome, format_ranks


class RankFailure(Exception):
    """A test failed on the ranks; ``text`` is the full grouped report, ``headline`` the one-line
    summary, ``crash`` the (file, line) of the first failing rank's failure when known."""

    def __init__(self, headline: str, text: str, crash: tuple[str, int] | None = None) -> None:
        super().__init__(headline)
        self.headline = headline
        self.text = text
        self.crash = crash


@dataclass
class Crash:
    message: str
    path: str
    lineno: int

    def toterminal(self, tw: Any) -> None:  # pragma: no cover - pytest calls it for some summaries
        tw.line(str(self))

    def __str__(self) -> str:  # what --tb=line prints
        return f"{self.path}:{self.lineno}: {self.message}"


class TPLongRepr:
    """A report body made of plain text lines; duck-types what pytest's reports need (toterminal,
    reprcrash)."""

    def __init__(self, text: str, headline: str, path: str, lineno: int,
                 style: str = "auto") -> None:
        self.text = text
        self.reprcrash = Crash(headline, path, lineno)
        # pytest's --tb; "line" prints only the crash line, which pytest writes itself
        self.style = style

    def toterminal(self, tw: Any) -> None:
        if self.style == "line":
            return
        for line in self.text.splitlines():
            if line.startswith("E "):
                tw.line(line, red=True, bold=True)
            else:
                tw.line(line)

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict[str, Any]:
        """Plain data for pytest-xdist's report transport (``from_dict`` rebuilds it on the
        controller)."""
        c = self.reprcrash
        return {"text": self.text, "headline": c.message, "path": c.path, "lineno": c.lineno,
                "style": self.style}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TPLongRepr:
        return cls(data["text"], data["headline"], data["path"], int(data["lineno"]),
                   data.get("style", "auto"))


def longrepr_for(item: Any, text: str, headline: str, crash: tuple[str, int] | None) -> TPLongRepr:
    """The report body of a TP failure of ``item``, located at ``crash`` (the failing line) or else
    at the test."""
    if crash is not None:
        path, lineno = crash
    else:
        where, line0, _ = item.reportinfo()
        path, lineno = str(where), (line0 or 0) + 1
    return TPLongRepr(text, headline, str(path), lineno,
                      style=item.config.getoption("tbstyle", "auto"))


_RANK_SECTION = re.compile(r"^Captured (?:stdout|stderr) rank (\d+)")


def rank_sections(outputs: dict[int, tuple[str, str]], label: str = "") -> list[tuple[str, str]]:
    """``(key, text)`` per rank and stream with output, keys ``"stdout rank N<label>"`` as
    ``item.add_report_section("call", key, text)`` takes them: pytest titles them ``Captured <key>
    call``, which :data:`_RANK_SECTION` reads back."""
    return [(f"{stream} rank {r}{label}", text) for r, pair in sorted(outputs.items())
            for stream, text in zip(("stdout", "stderr"), pair) if text]


def label_rank_lines(title: str, text: str) -> str:
    """Prefix every line of a rank's captured output with ``[rank N]``, in the teardown report only.

    JUnit XML (``-o junit_logging=...``) writes the teardown report's captured output as one
    ``system-out`` / ``system-err`` text, joining the sections without their titles; the prefix
    keeps each line's rank. The terminal shows the call report's sections, whose titles already name
    the rank.
    """
    m = _RANK_SECTION.match(title)
    if m is None:
        return text
    return "".join(f"[rank {m.group(1)}] {line}" for line in text.splitlines(keepends=True))


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+")
#: Where the code that runs a test body lives (this plugin, pytest, pluggy, multiprocessing, the
#: interpreter's start-up): frames hidden from stacks, as pytest hides its own frames from
#: tracebacks.
_HARNESS = ("/pytest_tplogp/", "/_pytest/", "/pluggy/", "/multiprocessing/",
            "/torch/multiprocessing/",
            "/pytest/__main__.py", "<frozen runpy>", "/runpy.py", "/threading.py")


#: The plugin's frames that call a test body (or a ``tp_pool.run`` function): everything from there
#: out is harness.
_RUNNER = re.compile(r"pytest_tplogp/(?:rank|external)\.py:(?:run_test|call)$")


def _is_harness(path: str) -> bool:
    path = path.replace("\\", "/")
    return any(part in path for part in _HARNESS)


def _threads(stack: str) -> list[list[str]]:
    """A faulthandler dump split into threads, each a list of lines (its header first)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    return [b.rstrip().splitlines() for b in blocks if b.strip()]


def _frames(lines: list[str]) -> list[tuple[str, int, str]]:
    return [(m["path"], int(m["line"]), m["func"]) for m in map(_FRAME.match, lines) if m]


def _runs_test(frames: list[tuple[str, int, str]]) -> bool:
    return any(_RUNNER.search(f"{p}:{f}") for p, _, f in frames)


def _test_thread(threads: list[list[str]], test_file: str | None) -> int | None:
    """Index of the thread that runs the test: the one with a frame in the test's file, else the
    rank's loop."""
    frames = [_frames(t) for t in threads]
    for pick in ((lambda fr: bool(test_file) and any(p == test_file for p, _, _ in fr)),
                 _runs_test):
        found = next((i for i, fr in enumerate(frames) if fr and pick(fr)), None)
        if found is not None:
            return found
    return None


def trim_stack(stack: str, test_file: str | None) -> str:
    """A rank's faulthandler dump without what runs the test: the thread that runs it keeps its
    frames down to the outermost one that is not the harness's (pytest_tplogp, pytest, pluggy,
    multiprocessing); the plugin's own threads (watchdogs) are left out; other threads are kept
    whole. Thread addresses are dropped, so the stacks of ranks that wait in the same place are the
    same text (and grouped)."""
    threads = _threads(stack)
    main = _test_thread(threads, test_file)
    if main is None:
        return "\n".join(line for t in threads for line in t)
    out: list[str] = []
    hidden_frames = hidden_threads = 0
    for i, lines in enumerate(threads):
        body = [line for line in lines if not _THREAD.match(line)]
        if i == main:
            # down to the plugin's call of the body (rank.py / external.py), else the innermost
            # harness run
            keep = next((k for k, line in enumerate(body) if (m := _FRAME.match(line))
                         and _RUNNER.search(
                f'{m["path"]}:{m["func"]}')), len(body))
            while keep and (m := _FRAME.match(body[keep - 1])) and _is_harness(m["path"]):
                keep -= 1
            hidden_frames += len(body) - keep
            out[:0] = body[:keep]
        elif any("/pytest_tplogp/" in p.replace("\\", "/") for p, _, _ in _frames(body)):
            hidden_threads += 1
        else:
            out += ["", "Another thread (most recent call first):", *body]
    if hidden_frames or hidden_threads:
        what = ([f"{hidden_frames} frame(s) of pytest_tplogp, pytest and pluggy below the test"]
                if hidden_frames else [])
        what += [f"{hidden_threads} thread(s) of pytest_tplogp"] if hidden_threads else []
        out.append(f"  ({' and '.join(what)} not shown)")
    return "\n".join(out)


def where_waiting(stack: str, test_file: str | None) -> str:
    """One line from a faulthandler dump: the innermost frame of the thread running the test, and
    the test's line."""
    threads = _threads(stack)
    main = _test_thread(threads, test_file)
    best = _frames(threads[main]) if main is not None else None
    if not best:
        return "no Python stack (did not answer SIGUSR1)"
    path, line, func = best[0]
    where = f"{func} ({_short(path)}:{line})"
    if test_file:
        for p, ln, fn in best:
            if p == test_file:
                if (p, ln, fn) != best[0]:
                    where += f" called from {fn} ({_short(p)}:{ln})"
                break
    return where


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    for anchor in ("site-packages", "torch", "pytest_tplogp", "tplogp"):
        if anchor in parts[:-1]:
            return "/".join(parts[parts.index(anchor) + (1 if anchor == "site-packages" else 0):])
    return "/".join(parts[-2:])


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.rstrip().splitlines())


@dataclass
class Verdict:
    outcome: str  # passed | failed | skipped | xfailed
    headline: str = ""
    text: str = ""
    # set when every rank failed with the same exception type ("module:qualname")
    exc_type: str = ""
    crash: tuple[str, int] | None = None  # (file, line) of the first failing rank's failure


def merge(run: PoolRun, world_size: int, *, timeout_s: float, test_file: str | None,
          pool_desc: str) -> Verdict:
    """Merge one :class:`PoolRun` into a :class:`Verdict` (see the module docstring)."""
    outs = run.outcomes
    kinds = {o.outcome for o in outs.values()}
    complete = len(outs) == world_size and not run.deaths and not run.stuck
    if complete and kinds == {"passed"} and not run.unmatched:
        return Verdict("passed")
    if complete and kinds == {"skipped"}:
        return Verdict("skipped", headline=_grouped_reasons(outs))
    if complete and kinds == {"xfailed"}:
        return Verdict("xfailed", headline=_grouped_reasons(outs))

    sections: list[str] = []
    heads: list[str] = []
    deaths: list[str] = []  # a dead rank is the cause: named first, its peers' errors after it
    for r, why in sorted(run.deaths.items()):
        deaths.append(f"rank {r} {why}")
        text = f"rank {r} {why} while running the test"
        if run.death_stacks.get(r, "").strip():
            stack = _indent(trim_stack(run.death_stacks[r], test_file))
            text += f"\n  fatal-signal stack (faulthandler):\n{stack}"
        sections.append(text)
    failed = {r: o for r, o in outs.items() if o.outcome == "failed"}
    groups: dict[str, dict[str, list[int]]] = {}  # headline -> traceback -> ranks
    for r, o in sorted(failed.items()):
        groups.setdefault(o.summary, {}).setdefault(o.longrepr, []).append(r)
    for summary, tracebacks in groups.items():
        ranks = sorted(r for rs in tracebacks.values() for r in rs)
        heads.append(f"{format_ranks(ranks)}: {_collateral(summary) if deaths else summary}")
        if len(tracebacks) == 1:
            longrepr = next(iter(tracebacks))
            body = _indent(longrepr) if longrepr else ""
        # one headline, tracebacks that differ (e.g. in the values an assert shows): each once, with
        # its ranks
        else:
            body = "\n".join(f"  {format_ranks(rs)}:\n{_indent(tb, '      ')}" for tb,
                             rs in tracebacks.items())
        sections.append(f"{format_ranks(ranks)} failed: {summary}\n{body}".rstrip())
    passed = sorted(r for r, o in outs.items() if o.outcome == "passed")
    if passed:
        sections.append(f"{format_ranks(passed)} passed.")
    skipped = {r: o for r, o in outs.items() if o.outcome in ("skipped", "xfailed")}
    if skipped:
        others = sorted(set(range(world_size)) - set(skipped))
        heads.append(f"skip not agreed: {format_ranks(list(skipped))} skipped")
        sections.append(
            f"skip not agreed by all ranks: {format_ranks(list(skipped))} skipped "
            f"({_grouped_reasons(skipped)}) but {format_ranks(others)} did not.\n  A skip inside a "
            "TP test must be taken by every rank: decide it collectively with tp.skip_if(cond, "
            "reason) or inside `with tp.agree():`."
            if others else "")
    if run.stuck:
        stuck = sorted(run.stuck)
        finished = sorted(outs)
        if run.timed_out:
            head = f"deadline of {timeout_s:g} s exceeded: {format_ranks(stuck)} still running"
        else:
            head = (f"{format_ranks(stuck)} did not finish within {STRAGGLER_GRACE_S:g} s after "
                    f"{'a peer failed or skipped' if not run.deaths else 'a peer died'} (stuck in "
                    "a collective?)")
        heads.insert(0, head) if run.timed_out else heads.append(head)
        lines = [f"{head}; finished: {format_ranks(finished) if finished else 'none'}"]
        waits: dict[str, list[int]] = {}
        for r in stuck:
            waits.setdefault(where_waiting(run.stuck[r].stack, test_file), []).append(r)
        for where, ranks in waits.items():
            pids = ", ".join(str(run.stuck[r].pid) for r in ranks)
            lines.append(f"  {format_ranks(ranks)} ({'pid' if len(ranks) == 1 else 'pids'} {pids}) "
                         f"waiting in {where}")
        stacks: dict[str, list[int]] = {}
        for r in stuck:
            stacks.setdefault(trim_stack(run.stuck[r].stack, test_file).rstrip() or "(empty)",
                              []).append(r)
        for text, ranks in stacks.items():
            lines.append(f"--- {format_ranks(ranks)} stack (faulthandler, SIGUSR1) ---\n{text}")
        sections.append("\n".join(lines))
    if run.unmatched:
        heads.append(f"collective left unmatched: {run.unmatched}")
        sections.append(f"collective left unmatched after the body: {run.unmatched}. Wait for "
                        f"every async_op=True collective (work.wait()) and issue each one on every "
                        f"rank of its group.")
    if run.killed:
        sections.append(f"pool ({pool_desc}) killed ({run.killed}); a fresh pool starts for the "
                        "next test.")
    if deaths:
        after = "; ".join(h for h in heads if h)
        then = f"then on its peers: {after}" if len(deaths) == 1 else f"then: {after}"
        heads = deaths + ([then] if after else [])
    headline = "; ".join(h for h in heads if h) or "failed on the ranks"
    text = "\n\n".join(s for s in sections if s)
    types = {o.exc_type for o in failed.values()}
    common = types.pop() if (complete and len(failed) == world_size and len(types) == 1) else ""
    crash = next((o.crash for _, o in sorted(failed.items()) if o.crash), None)
    return Verdict("failed", headline=headline, text="E   " + headline + "\n\n" + text,
                   exc_type=common, crash=crash)


_SOURCE_PREFIX = re.compile(r"^(\w[\w.]*: )\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")


def _collateral(summary: str) -> str:
    """A peer's error after a rank died, shortened for the headline: without the C++ source location
    and the advice after the first sentence (gloo's ``... by peer. This is typically ...``)."""
    short = _SOURCE_PREFIX.sub(r"\1", summary)
    return short.partition(". ")[0]


def failure_class(exc_type: str) -> type:
    """:class:`RankFailure`, or a subclass that is also the ranks' exception type when that type is
    importable.

    So ``@pytest.mark.xfail(raises=ValueError)`` matches a TP test whose body raised ValueError on
    every rank.
    """
    if not exc_type:
        return RankFailure
    import importlib

    module_name, _, qualname = exc_type.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if (not (isinstance(obj, type) and issubclass(obj, Exception))
            or issubclass(obj, RankFailure)):
            return RankFailure
        return type(f"RankFailure[{obj.__name__}]", (RankFailure, obj), {"__module__": __name__})
    # noqa: BLE001 - not importable, or a layout that cannot be combined: plain RankFailure
    except Exception:
        return RankFailure


def _grouped_reasons(outs: dict[int, RankOutcome]) -> str:
    by: dict[str, list[int]] = {}
    for r, o in sorted(outs.items()):
        by.setdefault(o.summary, []).append(r)
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{format_ranks(rs)}: {reason}" for reason, rs in by.items())
