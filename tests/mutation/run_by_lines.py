"""Run mutmut's mutants against the tests that execute the mutated line, not every test of the function.

mutmut 3 picks, for each mutant, the tests that called the mutated *function* in the test's own thread. For
the coordinator that is nearly the whole selection (every test schedules functions), so a surviving mutant
costs minutes, and code that Dask worker threads run is linked to no test at all. This script instead uses
a per-test line map made by ``coverage run`` over the whole suite (``linemap_plugin.py`` switches the
coverage context at each test, for every thread), and runs each mutant with the tests that executed the
statement it changed, fastest first, stopping at the first failure. A test that never executes a statement
cannot see a change to it, so the verdicts are mutmut's, reached sooner.

Usage (from the repository root, after ``mutmut run`` has written ``mutants/``; see ``tests/README.md``)::

    DASKPS_TEST_THREAD_WORKERS=1 LINEMAP_OUTCOMES=linemap-outcomes.json PYTHONPATH=tests/mutation \\
        python -m coverage run --source=daskps -m pytest -p linemap_plugin -p no:cacheprovider --timeout=400
    python tests/mutation/run_by_lines.py daskps.trainer.datasets --jobs 2 --results mutation-results.jsonl
    python tests/mutation/run_by_lines.py --report --results mutation-results.jsonl

Verdicts: ``killed`` (a test failed; its id is kept), ``timeout`` (the mutant hung: killed, as mutmut counts
it), ``survived`` (every test that executes the statement passed), ``no tests`` (no test executes it).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import difflib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

_NAME = re.compile(r"^(?P<module>[\w.]+)\.(?P<func>x[_ǁ][^.]*?)__mutmut_(?P<n>\d+)$")


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


class _Module:
    """One mutated module: the mutants' sources and the original's statements."""

    def __init__(self, root: Path, module: str):
        rel = Path(*module.split(".")).with_suffix(".py")
        self.path = (root / rel).resolve()
        self.original = self.path.read_text()
        self.mutated = (root / "mutants" / rel).read_text()
        self._mutated_lines = self.mutated.splitlines()
        self._mutated_defs = _functions(ast.parse(self.mutated))
        self._original_tree = ast.parse(self.original)
        self._statements = [n for n in ast.walk(self._original_tree) if isinstance(n, ast.stmt)]

    def _original_def(self, mangled: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        parts = mangled[1:].split("ǁ") if mangled.startswith("xǁ") else [mangled[2:]]
        scope: ast.AST = self._original_tree
        for part in [p for p in parts if p]:
            found = [n for n in ast.iter_child_nodes(scope)
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part]
            if not found:
                raise LookupError(f"{mangled}: no {part!r} in {self.path}")
            scope = found[0]
        assert isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
        return scope

    def _body(self, name: str) -> list[str]:
        node = self._mutated_defs[name]
        return self._mutated_lines[node.lineno:node.end_lineno]  # the lines after `def`

    def changed_lines(self, mangled: str, n: int) -> list[int]:
        """The original module's line numbers the mutant changes."""
        a, b = (self._body(f"{mangled}__mutmut_{suffix}") for suffix in ("orig", n))
        changed: set[int] = set()
        for op, i1, i2, _j1, _j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op in ("replace", "delete"):
                changed.update(range(i1, i2))
            elif op == "insert":
                changed.add(max(i1 - 1, 0))
        start = self._original_def(mangled).lineno
        return sorted(start + 1 + i for i in changed)

    def statement_lines(self, line: int) -> range:
        """The lines of the innermost statement holding ``line`` (a compound statement's header only)."""
        best = None
        for node in self._statements:
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (best is None or node.lineno >= best.lineno and end <= (best.end_lineno or 0)):
                best = node
        if best is None:
            return range(line, line + 1)
        bodies = [getattr(best, f) for f in ("body", "orelse", "finalbody", "handlers") if getattr(best, f, None)]
        firsts = [b[0].lineno for b in bodies if isinstance(b, list) and b and isinstance(b[0], (ast.stmt, ast.excepthandler))]
        header_end = min([f for f in firsts if f > best.lineno] or [(best.end_lineno or best.lineno) + 1]) - 1
        if line <= header_end:
            return range(best.lineno, header_end + 1)
        return range(line, line + 1)  # an `else:`/`finally:` line: itself


class LineMap:
    def __init__(self, data_file: str, outcomes_file: str):
        import coverage

        self._data = coverage.CoverageData(basename=data_file)
        self._data.read()
        self._by_file: dict[str, dict[int, list[str]]] = {}
        with open(outcomes_file) as f:
            self.outcomes: dict[str, dict[str, object]] = json.load(f)

    def tests(self, path: Path, lines: list[int], module: _Module) -> list[str]:
        key = str(path)
        if key not in self._by_file:
            self._by_file[key] = self._data.contexts_by_lineno(key)
        by_line = self._by_file[key]
        found: set[str] = set()
        for line in lines:
            for each in module.statement_lines(line):
                found.update(c for c in by_line.get(each, ()) if c)
        passing = [t for t in found if self.outcomes.get(t, {}).get("outcome") == "passed"]
        return sorted(passing, key=lambda t: float(self.outcomes[t]["duration"]))  # type: ignore[arg-type]


def _failed_test(output: str) -> str | None:
    """The node id of the failed test (ids of parametrized tests may hold spaces; pytest's summary adds
    `` - <message>``)."""
    m = re.search(r"^KILLED BY (.+)$", output, re.M) or re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)
    return m.group(1) if m else None


def serve() -> None:
    """A fork server, in ``mutants/``: imports once, then forks one child per mutant that runs pytest.

    Importing numpy, pandas, Dask and daskps costs each fresh pytest about 4 s of CPU, more than most
    mutants' tests. Reads a job per line on stdin, answers ``{"rc": exit code or null, "output": file}``.
    Single-threaded (forking a process with threads can leave a lock held in the child).
    """
    import importlib
    import pkgutil
    import tempfile

    sys.path.insert(0, os.getcwd())
    for name in ("numpy", "pandas", "dask", "dask.array", "dask.dataframe", "distributed", "pytest",
                 "pytest_timeout", "hypothesis", "bokeh.plotting"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import daskps

    for info in pkgutil.walk_packages(daskps.__path__, "daskps."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional extra missing: the tests that need it skip
            pass
    if threading.active_count() != 1:
        print(f"fork server: threads after imports: {threading.enumerate()}", file=sys.stderr)
    for line in sys.stdin:
        job = json.loads(line)
        fd, out = tempfile.mkstemp(prefix="mutant-", suffix=".log")
        pid = os.fork()
        if pid == 0:  # the child: its own process group, so that a timeout takes what it started too
            try:
                os.setsid()
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ["MUTANT_UNDER_TEST"] = job["mutant"]
                import pytest

                code = int(pytest.main(job["args"], plugins=[_FirstFailure()]))
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 99
            os._exit(code)
        os.close(fd)
        deadline = time.monotonic() + job["timeout"]  # then what it started goes too (its process group)
        rc = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                _kill_group(pid)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        _kill_group(pid)  # worker processes a test started and left behind
        print(json.dumps({"rc": rc, "output": out}), flush=True)


class _FirstFailure:
    """In a mutant's child: at the first failing test, say which and exit (no teardown to hang on); once
    the last test has passed, say so (a session fixture's teardown that hangs then changes nothing)."""

    def __init__(self) -> None:
        self.left = 0

    def pytest_collection_finish(self, session):  # type: ignore[no-untyped-def]
        self.left = len(session.items)

    def pytest_runtest_logreport(self, report):  # type: ignore[no-untyped-def]
        if (report.when == "call" and report.passed) or (report.when == "setup" and report.skipped):
            self.left -= 1
            if self.left == 0:
                print(f"\n{ALL_PASSED}", flush=True)
        if report.failed:
            timed_out = "from pytest-timeout" in str(report.longrepr)
            last = (str(report.longrepr).strip().splitlines() or [""])[-1][:300]  # to tell a real kill from a flake
            print(f"\nKILLED BY {report.nodeid}\nREASON {last}\n{'+++++++ Timeout' if timed_out else ''}", flush=True)
            sys.stderr.flush()
            os._exit(1)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


ALL_PASSED = "every test passed"
_servers = threading.local()


def _server(root: Path) -> subprocess.Popen[str]:
    server = getattr(_servers, "proc", None)
    if server is None or server.poll() is not None:
        server = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=root / "mutants", text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _servers.proc = server
    return server


def run_one(root: Path, name: str, tests: list[str], per_test: int, whole: int) -> dict[str, object]:
    if not tests:
        return {"mutant": name, "verdict": "no tests", "tests": 0}
    args = ["-x", "-q", "--tb=line", "-p", "no:cacheprovider", "-n", "0", f"--timeout={per_test}", *tests]  # line: no source parsed
    start = time.monotonic()
    server = _server(root)
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"mutant": name, "args": args, "timeout": whole}) + "\n")
    server.stdin.flush()
    answer = json.loads(server.stdout.readline())
    with open(answer["output"]) as f:
        out = f.read()
    os.unlink(answer["output"])
    row: dict[str, object] = {"mutant": name, "tests": len(tests), "seconds": round(time.monotonic() - start, 1)}
    rc = answer["rc"]
    if rc is None:  # the whole run's deadline: not a verdict, unless the tests were all through
        return {**row, "verdict": "survived" if ALL_PASSED in out else "unfinished"}
    if rc == 0:
        return {**row, "verdict": "survived"}
    if rc == 1:
        reason = re.search(r"^REASON (.*)$", out, re.M)
        return {**row, "verdict": "timeout" if "+++++++ Timeout" in out else "killed", "by": _failed_test(out),
                "reason": reason.group(1) if reason else None}
    if rc < 0:  # the test process died of a signal the mutant caused
        return {**row, "verdict": "killed", "by": f"signal {-rc}"}
    return {**row, "verdict": "error", "rc": rc, "tail": out[-2000:]}


def _all_mutants(root: Path, prefixes: list[str]) -> list[str]:
    names = []
    for meta in sorted((root / "mutants").rglob("*.py.meta")):
        for key in json.loads(meta.read_text())["exit_code_by_key"]:
            if any(key.startswith(p + ".") for p in prefixes):
                names.append(key)
    return names


def _killed_by_mutmut(code: int | None) -> bool:
    """mutmut's exit codes: 1, a test failed; below 0, a timeout or a signal; 0 survived, 33 no tests."""
    return code is not None and (code == 1 or code < 0)


def generate() -> None:
    """mutmut's first step alone: the sources copied to ``mutants/``, each function with its mutants."""
    from mutmut import __main__ as mutmut_main
    from mutmut.mutation.trampoline import set_mutant_under_test

    set_mutant_under_test("mutant_generation")
    os.makedirs("mutants", exist_ok=True)
    mutmut_main.copy_src_dir()
    mutmut_main.copy_also_copy_files()
    mutmut_main.setup_source_paths()
    stats = mutmut_main.create_mutants(os.cpu_count() or 2)
    print(f"mutants/: {stats.mutated} files mutated")


def verify(root: Path, results: Path, per_test: int) -> None:
    killers: dict[str, list[str]] = defaultdict(list)
    for line in results.read_text().splitlines():
        row = json.loads(line)
        by = str(row.get("by") or "")
        if row["verdict"] == "killed" and "::" in by:
            killers[by].append(str(row["mutant"]))
    failing = 0
    for i, (test, mutants) in enumerate(sorted(killers.items()), 1):
        row = run_one(root, "no.mutant", [test], per_test, 10 * per_test)
        if row["verdict"] != "survived":  # no mutant: "survived" is a pass
            failing += 1
            print(f"FAILS WITHOUT A MUTANT ({row['verdict']}): {test}; it killed {len(mutants)}: {mutants}")
        print(f"[{i}/{len(killers)}] {test}: {'passes' if row['verdict'] == 'survived' else 'fails'}", flush=True)
    print(f"{len(killers)} killing tests, {failing} failing without a mutant")


def report(results: Path, mutmut_meta: Path | None) -> None:
    """A table per module: this script's verdicts, and (from ``mutmut_meta``) what mutmut's own runs killed."""
    latest: dict[str, dict[str, object]] = {}
    for line in results.read_text().splitlines():
        row = json.loads(line)
        latest[str(row["mutant"])] = row
    verdicts = {name: str(row["verdict"]) for name, row in latest.items()}
    if mutmut_meta is not None:
        for meta in mutmut_meta.rglob("*.py.meta"):
            for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if key not in verdicts and _NAME.match(key):
                    verdicts[key] = "killed by mutmut" if _killed_by_mutmut(code) else "not run"
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    for name, verdict in verdicts.items():
        m = _NAME.match(name)
        by_module[m.group("module") if m else "?"][verdict] += 1
    columns = ["killed by mutmut", "killed", "timeout", "survived", "survived fast", "no tests", "not run"]
    print("| module | mutants | " + " | ".join(columns) + " | other | kill rate |")
    print("| --- | ---: | " + " | ".join("---:" for _ in columns) + " | ---: | ---: |")
    for module, c in sorted(by_module.items()):
        if module not in {_NAME.match(n).group("module") for n in latest if _NAME.match(n)}:  # type: ignore[union-attr]
            continue
        total = sum(c.values())
        dead = c["killed by mutmut"] + c["killed"] + c["timeout"]
        other = total - sum(c[k] for k in columns)
        print(f"| `{module}` | {total} | " + " | ".join(str(c[k]) for k in columns)
              + f" | {other} | {100 * dead / total:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="module names (daskps.trainer.datasets) or mutant names")
    parser.add_argument("--results", default="mutation-results.jsonl", type=Path)
    parser.add_argument("--coverage-data", default=".coverage")
    parser.add_argument("--outcomes", default="linemap-outcomes.json")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--per-test-timeout", type=int, default=120)
    parser.add_argument("--mutant-timeout", type=int, default=900)
    parser.add_argument("--rerun", action="store_true", help="run mutants the results file already has")
    parser.add_argument("--only", help="verdicts to rerun with --rerun (comma-separated, e.g. survived)")
    parser.add_argument("--skip-killed-in", type=Path,
                        help="a folder of mutmut's *.py.meta files: mutants mutmut already killed are not run")
    parser.add_argument("--report", action="store_true", help="print the table of the results file and stop")
    parser.add_argument("--tests", action="append", default=[],
                        help="run the mutants with these tests (node ids) instead of the map's: a test written "
                             "after the map was made (implies --rerun of the mutants named)")
    parser.add_argument("--exclude", help="a regular expression: tests whose ids match are not run (those that "
                        "fail with thread workers, which every mutant's run has)")
    parser.add_argument("--fast", type=float, help="a first pass: only tests that took at most this many "
                        "seconds in the map's run; a mutant they all pass is 'survived fast' (rerun it "
                        "without --fast, with --rerun --only 'survived fast', for the rest)")
    parser.add_argument("--shuffle", type=int, metavar="SEED",
                        help="run the mutants in a random order: a run stopped early checked a random sample")
    parser.add_argument("--dry-run", action="store_true", help="list each mutant's lines and test count")
    parser.add_argument("--verify", action="store_true",
                        help="run each test that killed a mutant with no mutant: it must pass (a test that "
                             "fails anyway under load killed nothing); prints those that fail")
    parser.add_argument("--generate", action="store_true",
                        help="write mutants/ as `mutmut run` does, without its test runs (mutmut 3.8's steps)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    root = Path.cwd()
    if args.report:
        report(args.results, args.skip_killed_in)
        return
    if args.generate:
        generate()
        return
    if args.verify:
        verify(root, args.results, args.per_test_timeout)
        return
    done: dict[str, str] = {}
    if args.results.exists():
        for line in args.results.read_text().splitlines():
            row = json.loads(line)
            done[row["mutant"]] = row["verdict"]
    names = [n for n in args.modules if "__mutmut_" in n]
    names += _all_mutants(root, [m for m in args.modules if "__mutmut_" not in m])
    if args.skip_killed_in:
        for meta in args.skip_killed_in.rglob("*.py.meta"):
            for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if _killed_by_mutmut(code) and key not in done:
                    done[key] = "killed by mutmut"
    if args.rerun or args.tests:
        wanted = set(args.only.split(",")) if args.only else None
        names = [n for n in names if wanted is None or done.get(n) in wanted]
    else:
        names = [n for n in names if n not in done]
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(names)
    linemap = LineMap(args.coverage_data, args.outcomes)
    modules: dict[str, _Module] = {}
    plan = []
    for name in names:
        m = _NAME.match(name)
        assert m, name
        mod = modules.get(m.group("module")) or modules.setdefault(m.group("module"), _Module(root, m.group("module")))
        lines = mod.changed_lines(m.group("func"), int(m.group("n")))
        tests = args.tests or linemap.tests(mod.path, lines, mod)
        if args.exclude:
            tests = [t for t in tests if not re.search(args.exclude, t)]
        slow = 0
        if args.fast is not None and not args.tests:
            quick = [t for t in tests if float(linemap.outcomes[t]["duration"]) <= args.fast]  # type: ignore[arg-type]
            slow, tests = len(tests) - len(quick), quick
        plan.append((name, lines, tests, slow))
    if args.dry_run:
        for name, lines, tests, slow in plan:
            print(name, lines, len(tests), slow)
        return
    lock = threading.Lock()
    counts: Counter[str] = Counter()

    def work(item: tuple[str, list[int], list[str], int]) -> None:
        name, lines, tests, slow = item
        if not tests and slow:
            row: dict[str, object] = {"mutant": name, "verdict": "survived fast", "tests": 0}
        else:
            row = run_one(root, name, tests, args.per_test_timeout, args.mutant_timeout)
        if slow and row["verdict"] in ("survived", "no tests"):
            row["verdict"], row["slow tests left"] = "survived fast", slow
        row["lines"] = lines
        with lock:
            counts[str(row["verdict"])] += 1
            with args.results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{sum(counts.values())}/{len(plan)}] {name}: {row['verdict']} ({row.get('seconds', 0)} s, "
                  f"{row['tests']} tests) {dict(counts)}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(work, plan))


if __name__ == "__main__":
    main()
