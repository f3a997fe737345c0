"""Every shell command in README.md and docs/**/*.md runs, at a reduced size, as a user would paste it.

Which text is a command (the rule; docs/experiments/ is left to the experiments' own runs):

* A fenced block whose info string is ``sh``, ``bash`` or ``shell`` is a script: each
  logical line (``\\``-continued lines joined, comment-only lines dropped, a trailing
  ``# comment`` cut) is one command.
* A fenced block with no info string, or ``console``, is a transcript: only lines starting
  with ``$ `` are commands; the lines after one, up to the next ``$ ``, are its output. The
  first output line is checked: an ``...: error: ...`` line means the command must fail and
  print that line up to its message's first colon; any other line must be printed as shown.
  Blocks without a ``$ `` line (an error message, a formula) are not commands.
* Any other language (``toml``, ``python``) is not a command. A block with a language
  this module does not know fails ``test_every_code_block_is_classified``, so that no new
  shell dialect is skipped unnoticed.

How each runs (``test_doc_command[PAGE:LINE]``): in one temporary directory per page, the
page's commands in order, with ``python`` and ``mpiexec`` first on PATH as wrappers of the
interpreter running pytest and the mpiexec beside it (or $MPIEXEC), ``.venv/`` meaning that
interpreter's venv, and a copy of ``jobs/`` and ``runs/.gitignore``, as in a checkout.
Selecting one command runs the page's earlier commands first. A run file a command reads
(``*.h5`` argument) that the page has not written is made first by the documented command
that writes it (``--out``), or by ``PROVIDERS``. Reductions (``REDUCE``): training 2 steps
without interim checkpoints (``--plan`` is left as written), benchmarks one repetition of a
few steps and sizes, the simulator at most 16 virtual ranks; ``mpiexec -n N`` is kept (N <= 4).
An ``hpcdl`` module or bench subcommand without an entry in ``REDUCE`` fails, so that a new
one gets its reduction when it is documented.

What is not run as written (``classify``):

* ``make TARGET``: dry, ``make -n`` (the target exists and its recipe expands): running it
  would install into the venv (``demo``) or run this suite (``test``).
* ``sbatch``, ``qsub`` (also from ``jobs/sweep.sh``): stubs that submit nothing; they check
  that the job script exists and parses (``bash -n``) and that the training arguments
  (after the script, or ``-v HPCDL_ARGS=...``) are valid (``python -m hpcdl.train ARGS --plan``).
  ``tests/test_jobs_slurm.py`` runs the Slurm script under a real Slurm, and
  ``tests/test_jobs.py`` both scripts under a fake scheduler.
* Skipped, with the reason in the report: ``module load``, ``python -m venv`` and ``pip
  install`` (a cluster's environment, built from the network), ``sudo`` (root; that line's
  test is ``tests/test_jobs_slurm.py``, in the suite), ``--vs torch`` when PyTorch is missing.
"""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXCLUDED = ("docs/experiments/",)  # the experiments' pages: their runs are make reproduce's (issue 22)
SCRIPT_LANGS = {"sh", "bash", "shell"}
TRANSCRIPT_LANGS = {"", "console"}
OTHER_LANGS = {"toml", "python", "text", "json"}
TIMEOUT_S = 120
MAX_RANKS = 4  # mpiexec -n N as written: N must stay small enough for CI's two cores
SIM_RANKS = 16  # python -m hpcdl.simulate -n N: at most this many virtual ranks

TRAIN = "--set train.steps=2 --set checkpoint.every=0 --progress none"
#: what is appended to each hpcdl command (the last ``-m hpcdl.X`` of the line; for bench,
#: by subcommand): later options win, so these override the documented sizes
REDUCE: dict[str, str] = {
    "hpcdl.train": TRAIN,
    "hpcdl.report": "",
    "hpcdl.config": "",
    "hpcdl.bench step": "--repeat 1 --steps 2",
    "hpcdl.bench train": "--repeat 1 --steps 2",
    "hpcdl.bench pipeline": "--reps 1 --steps 1 --warmup 0 --microbatches 2 --set data.batch_size=8",
    "hpcdl.bench allreduce": "--sizes 4K 64K --repeat 1 --min-time 0.001",
    "hpcdl.bench pack": "--repeat 1 --inner 1",
    "hpcdl.bench planner": "--ranks 8 --repeat 1",
    "hpcdl.bench ops": "--sizes 8 16 --repeat 1",
    "hpcdl.bench switch": "--workers 2 --seconds 0.2 --repeat 1",
    "hpcdl.bench exchange": "--repeat 1 --loss 0 0.1",
    # sizes far apart, up to 16M, and a few repeats, so the fit sees times grow on a loaded machine
    # too: with 4 ranks on 2 cores a small message can wait a scheduler quantum, which the largest
    # must outlast for a bandwidth to be fitted
    "hpcdl.bench calibrate": "--sizes 8 1M 16M --repeat 5 --min-time 0.01 --contention-repeat 1",
}
#: run files the docs read but no documented command writes with --out: the command that does
PROVIDERS: dict[str, str] = {
    # what `make demo` runs (Makefile)
    "runs/demo-*.h5": "mpiexec -n 2 python -m hpcdl.train --config digits-mlp --out runs/demo-test.h5",
    # one job of `jobs/sweep.sh optimizer.lr 0.01 0.03 0.1 -- --config digits-cnn` (docs/clusters.md)
    "runs/optimizer.lr-*.h5": "python -m hpcdl.train --config digits-cnn --set optimizer.lr=0.01 "
    "--out runs/optimizer.lr-0.01.h5",
}


#: tests/test_jobs.py runs `HPCDL_TEST_REAL=1 bash jobs/test/fake-scheduler.sh`, the documented
#: lines' superset: they are not run twice while it does
JOBS_TEST = (
    (ROOT / "tests" / "test_jobs.py").read_text() if (ROOT / "tests" / "test_jobs.py").exists() else ""
)
COVERS = ('"jobs/test/fake-scheduler.sh"', '"HPCDL_TEST_REAL": "1"')


@dataclass(frozen=True)
class Command:
    """One documented command: where it is, its text, and (transcripts) its first output line."""

    page: str
    line: int
    text: str
    expect: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


# --- extraction -------------------------------------------------------------------------


def pages() -> list[Path]:
    """README.md and docs/**/*.md, without the excluded directories."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if not p.relative_to(ROOT).as_posix().startswith(EXCLUDED)]


def blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """The fenced blocks of a Markdown text: (line of the first content line, language, lines)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [s[len(indent) :] if s.startswith(indent) else s for s in lines[i + 1 : j]]
        out.append((i + 2, lang.lower(), body))
        i = j + 1
    return out


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after whitespace, outside quotes)."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def _logical(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Join ``\\``-continued lines; (line number of the first, text) of the non-empty ones."""
    out: list[tuple[int, str]] = []
    start, parts = 0, []
    for k, raw in enumerate(lines):
        s = strip_comment(raw)
        if not parts:
            start = first + k
        if s.endswith("\\"):
            parts.append(s[:-1].strip())
            continue
        parts.append(s.strip())
        text = " ".join(p for p in parts if p)
        parts = []
        if text:
            out.append((start, text))
    return out


def commands(page: Path) -> list[Command]:
    """The commands of one page, in order (the rule in the module docstring)."""
    return commands_in(page.read_text(), page.relative_to(ROOT).as_posix())


def commands_in(text: str, name: str) -> list[Command]:
    """The commands of a Markdown text called ``name``, in order."""
    found = []
    for first, lang, lines in blocks(text):
        if lang in SCRIPT_LANGS:
            found += [Command(name, n, t) for n, t in _logical(lines, first)]
        elif lang in TRANSCRIPT_LANGS:
            for k, line in enumerate(lines):
                if not line.startswith("$ "):
                    continue
                cont = [line[2:]]
                while cont[-1].rstrip().endswith("\\") and k + len(cont) < len(lines):
                    cont.append(lines[k + len(cont)])
                output = [s for s in lines[k + len(cont) :] if s.strip()]
                expect = output[0] if output and not output[0].startswith("$ ") else ""
                found += [Command(name, n, t, expect) for n, t in _logical(cont, first + k)]
    return found


ALL = [c for p in pages() for c in commands(p)]


# --- what to do with a command ------------------------------------------------------------


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _words(cmd: str) -> list[str]:
    try:
        return shlex.split(cmd)
    except ValueError:
        return cmd.split()


#: commands not run, by a pattern of their text: why (the module docstring has the rule)
SKIPS: list[tuple[str, str]] = [
    (r"^module ", "a cluster's environment modules (module load): no module system here"),
    (r"\bpip install\b", "installs mpi4py/hpcdl from the network into a cluster's venv (CI: make)"),
    (r"\bpython\S* -m venv\b", "creates the venv for the pip install lines after it (a cluster's install)"),
    (r"^sudo ", "needs root (installs Slurm; tests/test_jobs_slurm.py is in the suite)"),
]


def classify(cmd: Command) -> tuple[str, str]:
    """("run", text), ("dry", text) or ("skip", reason) for a documented command."""
    words = _words(cmd.text)
    prog = next((w for w in words if not re.match(r"^\w+=", w)), "")
    for pattern, reason in SKIPS:
        if re.search(pattern, cmd.text):
            return "skip", reason
    if "jobs/test/fake-scheduler.sh" in cmd.text and all(s in JOBS_TEST for s in COVERS):
        return "skip", "tests/test_jobs.py runs it with HPCDL_TEST_REAL=1 (both lines; 2.5 min here)"
    if prog in ("sbatch", "qsub") or "jobs/sweep.sh" in words:
        return "dry", cmd.text  # sbatch and qsub on PATH are stubs (SUBMIT_STUB)
    if prog == "make":
        if not shutil.which("make"):
            return "skip", "make is not installed"
        return "dry", f"make -n -C {shlex.quote(str(ROOT))} " + shlex.join(words[1:])
    torch = re.search(r"--vs (torch\S*)", cmd.text)
    if torch and not _has_torch() and "bench pipeline" not in cmd.text:  # pipeline: one line, no torch
        return "skip", f"needs PyTorch (--vs {torch.group(1)}), which is not installed"
    text = cmd.text
    if re.search(r"(?<![\w./-])\.venv/", text):
        if sys.prefix == sys.base_prefix:
            return "skip", "names .venv/, and the tests do not run in a venv"
        text = re.sub(r"(?<![\w./-])\.venv/", sys.prefix.rstrip("/") + "/", text)
    return "run", reduce(text)


def reduce(text: str) -> str:
    """``text`` with the reductions of ``REDUCE`` applied (see the module docstring)."""
    words = _words(text)
    for k, w in enumerate(words):
        if w in ("--out", "--json", "--trace", "--table") and k + 1 < len(words):
            assert not os.path.isabs(words[k + 1]), f"{w} {words[k + 1]}: write under the current directory"
        if w == "mpiexec" and k + 2 < len(words) and words[k + 1] == "-n":
            assert int(words[k + 2]) <= MAX_RANKS, f"mpiexec -n {words[k + 2]}: at most {MAX_RANKS} here"
    mods = [k for k in range(len(words) - 1) if words[k] == "-m" and words[k + 1].startswith("hpcdl.")]
    if not mods:
        return text  # not an hpcdl command (or one inside bash -c '...'): as written
    last = words[mods[-1] + 1]
    if last == "hpcdl.simulate":
        raise AssertionError("python -m hpcdl.simulate without -m hpcdl.X: no reduction known")
    key = last
    if last == "hpcdl.bench":
        sub = words[mods[-1] + 2] if mods[-1] + 2 < len(words) else ""
        key = f"hpcdl.bench {sub}"
    if key not in REDUCE:
        raise AssertionError(f"no reduction known for {key!r}: add one to REDUCE in {Path(__file__).name}")
    extra = REDUCE[key]
    if key == "hpcdl.train" and "--plan" in words:
        extra = ""  # prints the placement and exits: nothing to reduce
    if key == "hpcdl.bench allreduce" and "--calibrate" in words:
        extra += " --runs 1"
    if "hpcdl.simulate" in words:  # fewer virtual ranks: -n before the command's -m
        head, sep, tail = text.partition(" -m " + last)
        head = re.sub(r"(?<!\S)-n\s+(\d+)", lambda m: f"-n {min(int(m.group(1)), SIM_RANKS)}", head)
        text = head + sep + tail
    return f"{text} {extra}".rstrip()


# --- the environment the commands run in ------------------------------------------------------


def _mpiexec() -> str:
    return os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


SUBMIT_STUB = r"""#!/usr/bin/env bash
# NAME stub (tests/test_docs_commands.py): submits nothing; checks the job script parses and
# the training arguments are valid (python -m hpcdl.train ARGS --plan)
set -euo pipefail
script=""; rest=(); hargs=""; prev=""
re_args="HPCDL_ARGS=('([^']*)'|\"([^\"]*)\"|([^,]*))"  # qsub -v: quoted, or up to a comma
for a in "$@"; do
    if [[ -z $script ]]; then
        if [[ $prev == -v && $a =~ $re_args ]]; then
            hargs="${BASH_REMATCH[2]}${BASH_REMATCH[3]}${BASH_REMATCH[4]}"
        fi
        if [[ -f $a ]]; then script=$a; fi
    else
        rest+=("$a")
    fi
    prev=$a
done
[[ -n $script ]] || { echo "NAME stub: no job script among the arguments: $*" >&2; exit 2; }
bash -n "$script"
if (( ${#rest[@]} == 0 )) && [[ -n $hargs ]]; then read -r -a rest <<< "$hargs"; fi
python -m hpcdl.train "${rest[@]}" --plan > /dev/null
echo "NAME stub: $script parses; its arguments plan: ${rest[*]}"
"""


@pytest.fixture(scope="session")
def stub_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for the front of PATH: python, mpiexec, sbatch and qsub."""
    bin_ = tmp_path_factory.mktemp("docs-bin")
    wrappers = {"python": sys.executable, "python3": sys.executable, "mpiexec": _mpiexec()}
    for name, target in wrappers.items():
        (bin_ / name).write_text(f'#!/bin/sh\nexec {shlex.quote(target)} "$@"\n')
    for name in ("sbatch", "qsub"):
        (bin_ / name).write_text(SUBMIT_STUB.replace("NAME", name))
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_


@dataclass
class Page:
    """One page's directory and the commands of it that have run there."""

    dir: Path
    done: set[str] = field(default_factory=set)


@pytest.fixture(scope="session")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Page]:
    return {}


def _page(page_dirs: dict[str, Page], tmp_path_factory: pytest.TempPathFactory, name: str) -> Page:
    if name not in page_dirs:
        d = tmp_path_factory.mktemp(re.sub(r"\W", "-", name))
        shutil.copytree(ROOT / "jobs", d / "jobs", ignore=shutil.ignore_patterns("experiments"))
        (d / "runs").mkdir()
        shutil.copy(ROOT / "runs" / ".gitignore", d / "runs" / ".gitignore")
        page_dirs[name] = Page(d)
    return page_dirs[name]


def _env(stub_bin: Path) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{stub_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg", HPCDL_TEST_VENV=sys.prefix)
    env.pop("HPCDL_SCHEDULER", None)
    return env


def _shell(text: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    run = ["bash", "-c", text]
    return subprocess.run(
        run, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _show(text: str, proc: subprocess.CompletedProcess) -> str:
    out, err = ("\n".join(s.splitlines()[-25:]) for s in (proc.stdout, proc.stderr))
    return f"$ {text}\n(exit {proc.returncode})\n--- stdout\n{out}\n--- stderr\n{err}"


def _inputs(text: str) -> list[str]:
    """The run files (``*.h5``, also ``table:FILE``) a command reads: not --out's, not VAR=."""
    words, found = _words(text), []
    for k, w in enumerate(words):
        w = w.removeprefix("table:")
        if w.endswith(".h5") and "=" not in w and not (k and words[k - 1] in ("--out", "--json", "--trace")):
            found.append(w)
    return found


def _writer(pattern: str, reader: Command) -> str:
    """The documented command that writes a file matching ``pattern`` (--out), or PROVIDERS'."""
    for c in ALL:
        words = _words(c.text)
        outs = [words[k + 1] for k in range(len(words) - 1) if words[k] == "--out"]
        if c != reader and any(fnmatch.fnmatch(o, pattern) for o in outs):
            return c.text
    for pat, text in PROVIDERS.items():
        if fnmatch.fnmatch(pattern, pat) or pattern == pat:
            return text
    raise AssertionError(
        f"{reader.id} reads {pattern}, which no documented --out writes: add it to PROVIDERS"
    )


def _provide(cmd: Command, page: Page, env: dict[str, str]) -> None:
    """Make the run files ``cmd`` reads that its page has not written."""
    for pattern in _inputs(cmd.text):
        if glob.glob(pattern, root_dir=page.dir):
            continue
        writer = reduce(_writer(pattern, cmd))
        proc = _shell(writer, page.dir, env)
        assert proc.returncode == 0, f"{cmd.id} reads {pattern}; making it failed:\n{_show(writer, proc)}"


def _run(cmd: Command, page: Page, env: dict[str, str]) -> None:
    """Run one command in its page's directory and check it (see the module docstring)."""
    page.done.add(cmd.id)
    action, text = classify(cmd)
    if action == "skip":
        pytest.skip(text)
    if action == "run":
        _provide(cmd, page, env)
    proc = _shell(text, page.dir, env)
    error = re.match(r"^\S+: error: [^:]*", cmd.expect)
    if error:
        assert proc.returncode != 0, f"documented to fail ({cmd.expect!r}); it did not:\n{_show(text, proc)}"
        assert error.group(0) in proc.stderr, f"documented to print {error.group(0)!r}:\n{_show(text, proc)}"
        return
    assert proc.returncode == 0, _show(text, proc)
    if cmd.expect:
        assert cmd.expect in proc.stdout, f"documented to print {cmd.expect!r}:\n{_show(text, proc)}"


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id) for c in ALL])
def test_doc_command(
    cmd: Command, stub_bin: Path, page_dirs: dict[str, Page], tmp_path_factory: pytest.TempPathFactory
) -> None:
    page = _page(page_dirs, tmp_path_factory, cmd.page)
    env = _env(stub_bin)
    for before in ALL[: ALL.index(cmd)]:  # the page's earlier commands, when this one runs alone (-k)
        if before.page == cmd.page and before.id not in page.done:
            page.done.add(before.id)
            action, text = classify(before)
            if action != "skip":
                if action == "run":
                    _provide(before, page, env)
                _shell(text, page.dir, env)
    _run(cmd, page, env)


def test_every_code_block_is_classified() -> None:
    """Every fenced block's language is one this module reads as commands or knows is not."""
    known = SCRIPT_LANGS | TRANSCRIPT_LANGS | OTHER_LANGS
    unknown = [
        f"{p.relative_to(ROOT)}:{first - 1} ```{lang}"
        for p in pages()
        for first, lang, _ in blocks(p.read_text())
        if lang not in known
    ]
    assert not unknown, f"code blocks of a language tests/test_docs_commands.py does not know: {unknown}"


SAMPLE = """\
# A page

```sh
make demo    # a comment
             # a comment line
mpiexec -n 2 python -m hpcdl.train --config digits-mlp \\
    --set 'name="a # b"' --out runs/a.h5   # trailing
```

```toml
lr = 0.1
```

```
$ python -m hpcdl.train --config digits-mlp --plan -n 4
strategy sync on 4 ranks
...
$ python -m hpcdl.config --set x=1
hpcdl.config: error: unknown config key 'x'
```

```
hpcdl.train: error: an error shown alone is not a command
```
"""


def test_the_rule_finds_commands() -> None:
    """The extraction: scripts, continuations, comments, transcripts and their output."""
    found = [(c.id, c.text, c.expect) for c in commands_in(SAMPLE, "p.md")]
    assert found == [
        ("p.md:4", "make demo", ""),
        (
            "p.md:6",
            "mpiexec -n 2 python -m hpcdl.train --config digits-mlp --set 'name=\"a # b\"' --out runs/a.h5",
            "",
        ),
        ("p.md:15", "python -m hpcdl.train --config digits-mlp --plan -n 4", "strategy sync on 4 ranks"),
        ("p.md:18", "python -m hpcdl.config --set x=1", "hpcdl.config: error: unknown config key 'x'"),
    ], found


def test_reductions() -> None:
    """What a command becomes: training shortened, --plan and others as written, -n of the simulator."""

    def run(text: str) -> tuple[str, str]:
        return classify(Command("p.md", 1, text))

    assert run("python -m hpcdl.train --config c --out runs/a.h5") == (
        "run",
        f"python -m hpcdl.train --config c --out runs/a.h5 {TRAIN}",
    )
    assert run("python -m hpcdl.train --config c --plan -n 1024")[1].endswith("-n 1024")
    sim = run("python -m hpcdl.simulate -n 1024 -m hpcdl.bench allreduce --sizes 1M")[1]
    assert sim.startswith(
        f"python -m hpcdl.simulate -n {SIM_RANKS} -m hpcdl.bench allreduce --sizes 1M --sizes 4K"
    ), sim
    assert run("module load openmpi")[0] == "skip"
    assert run("sbatch --job-name=x jobs/slurm/train.sbatch --config c") == (
        "dry",
        "sbatch --job-name=x jobs/slurm/train.sbatch --config c",
    )
    with pytest.raises(AssertionError, match="no reduction known"):
        run("python -m hpcdl.bench newthing")
    with pytest.raises(AssertionError, match="at most"):
        run("mpiexec -n 64 python -m hpcdl.train --config c")
