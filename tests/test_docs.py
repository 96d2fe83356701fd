"""The docs run: the README's example, every `simplefsdp ...` command line, every relative link, the
result records' headers and the README's quote of the latest scoreboard.

- The example: in the fast tier on one rank in this process, compiled with `simplefsdp_aot_eager`
  (the same trace and pass, no inductor: seconds); in the slow tier as the README says to run it,
  under torchrun with 2 gloo ranks and inductor.
- Commands: each `simplefsdp train | inspect | calibrate | precompile ...` line (and `-m simplefsdp.train` /
  `-m simplefsdp.calibrate` under torchrun) in README.md, docs/ and bench/README.md goes through
  `simplefsdp.cli.main` with argparse stopped right after it parsed: the subcommand's real parser
  accepts the flags, and nothing runs. A renamed flag fails here.
- Links: every relative link resolves to a file or folder, and every `#anchor` to a heading of its
  target (GitHub's heading slugs).
- Records: every `bench/results/*.md` run opens with its command, commit, host and date; the README
  quotes the latest scoreboard's rows as its record has them, with that record's command and date;
  dates appear nowhere else in the README and docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from simplefsdp import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
# measurements.md gathers the one-off measurements the code's notes cite: a date per section, below
MEASUREMENTS = ROOT / "bench" / "results" / "measurements.md"
RECORDS = sorted(
    p for p in (ROOT / "bench" / "results").glob("*.md") if p.name not in ("history.md", MEASUREMENTS.name)
)
DOCS = [README, *GUIDES, ROOT / "bench" / "README.md"]
LINKED = [*DOCS, *(ROOT / "bench" / "results").glob("*.md")]

_FENCE = re.compile(r"^[ \t]*```([\w-]*)\n(.*?)^[ \t]*```", re.M | re.S)  # also fences indented in a list
_SHELL = {"", "bash", "sh", "shell", "console"}
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fenced(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    for match in _FENCE.finditer(text):
        yield match.group(1), match.group(2)


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code spans."""
    return re.sub(r"`[^`]*`", "", _FENCE.sub("", text))


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


# ---------------------------------------------------------------------------------------- the example


def _readme_example() -> str:
    blocks = [body for lang, body in _fenced(_section(README.read_text(), "Example")) if lang == "python"]
    assert len(blocks) == 1, "the README's Example section holds one python block"
    return blocks[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_readme_example_runs_on_one_rank(monkeypatch, capsys):
    """The example's calls, as written, on one gloo rank here; compiled with the debugging backend
    (Dynamo, AOT autograd and simplefsdp's pass; no inductor) so that it takes seconds."""
    assert not dist.is_initialized(), "a process group is left over from another test"
    port = str(_free_port())
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="simplefsdp_aot_eager"))
    scope: dict[str, object] = {"__name__": "readme_example"}
    try:
        exec(compile(_readme_example(), "README.md (Example)", "exec"), scope)
        grads = [p.grad for p in scope["model"].parameters()]
        assert all(g is None for g in grads), "the example ends with opt.zero_grad()"
        assert scope["opt"].state, "the optimizer stepped"
        printed = re.findall(r"^step (\d): loss (\d+\.\d+)$", capsys.readouterr().out, re.M)
        assert [int(step) for step, _ in printed] == [1, 2, 3], "the loss of every step"
        assert float(printed[-1][1]) < float(printed[0][1]), "one batch, three steps: the loss falls"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # tests/_tiers.py: the fast test above runs the same lines on one rank, without inductor
@pytest.mark.timeout(300)
def test_readme_example_runs_under_torchrun_on_two_ranks(tmp_path):
    """The example as the README says to run it: `torchrun --nproc-per-node 2 example.py`."""
    script = tmp_path / "example.py"
    script.write_text(_readme_example())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# ------------------------------------------------------------------------------------------ commands

_SUBCOMMANDS = ("train", "inspect", "calibrate", "precompile")
_MODULES = {f"simplefsdp.{name}": name for name in ("train", "calibrate")}  # `python -m` / torchrun entry points
_SHELL_END = {"&&", "||", ";", "|", ">", ">>"}


def _argv(tokens: list[str]) -> list[str] | None:
    """`[subcommand, *args]` of the simplefsdp command in a shell line's tokens, or None."""
    for i, token in enumerate(tokens):
        if token == "simplefsdp" and i + 1 < len(tokens) and tokens[i + 1] in _SUBCOMMANDS:
            start, command = i + 2, tokens[i + 1]
        elif token == "-m" and i + 1 < len(tokens) and tokens[i + 1] in _MODULES:
            start, command = i + 2, _MODULES[tokens[i + 1]]
        else:
            continue
        rest = tokens[start:]
        end = next((j for j, t in enumerate(rest) if t in _SHELL_END), len(rest))
        return [command, *rest[:end]]
    return None


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """(where, argv) of every simplefsdp command line in a markdown file: lines of shell blocks
    (continuations joined), and inline code spans that give a subcommand at least one argument."""
    text, found = path.read_text(), []
    for lang, body in _fenced(text):
        if lang not in _SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = _argv(shlex.split(line, comments=True))
            if argv is not None:
                found.append((f"{_rel(path)}: {line.strip()}", argv))
    for span in re.findall(r"`([^`]+)`", _FENCE.sub("", text)):  # a span may continue on the next line
        named = re.search(r"\bsimplefsdp[ .](train|inspect|calibrate|precompile)\b", span)
        argv = _argv(shlex.split(span)) if named else None
        if argv is not None and len(argv) > 1:
            found.append((f"{_rel(path)}: `{' '.join(span.split())}`", argv))
    return found


class _ParsedError(Exception):
    """Raised by the patched `parse_args` once a parser has accepted the arguments."""


def _parses(argv: list[str]) -> tuple[bool, str]:
    """Whether `simplefsdp <argv>` gets past its subcommand's argparse parser, and what it printed.
    Nothing after the parse runs: `parse_args` raises as soon as the real parser returns."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _ParsedError

    out = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(argv)
    except _ParsedError:
        return True, out.getvalue()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        argparse.ArgumentParser.parse_args = real
    return code == 0 and ("--help" in argv or "-h" in argv), out.getvalue()


ALL_COMMANDS = [command for path in DOCS for command in _commands(path)]


def test_the_docs_hold_commands_of_every_subcommand():
    assert {argv[0] for _, argv in ALL_COMMANDS} == set(_SUBCOMMANDS)
    assert len(ALL_COMMANDS) >= 30, [where for where, _ in ALL_COMMANDS]


@pytest.mark.parametrize(("where", "argv"), ALL_COMMANDS, ids=[where for where, _ in ALL_COMMANDS])
def test_documented_command_parses(where, argv):
    ok, printed = _parses(argv)
    assert ok, f"{where}\n-> simplefsdp {' '.join(argv)}\n{printed}"


@pytest.mark.parametrize("command", ["train", "inspect tiny", "calibrate", "precompile"])
def test_the_command_check_rejects_an_unknown_flag(command):
    assert _parses([*command.split(), "--no-such-flag"])[0] is False
    assert _parses(command.split())[0] is True


# --------------------------------------------------------------------------------------------- links


def _slugs(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    seen: dict[str, int] = {}
    slugs = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def _links(path: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(path.read_text()))


@pytest.mark.parametrize("path", LINKED, ids=_rel)
def test_relative_links_resolve(path):
    broken = []
    for link in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:, ...
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in _slugs(resolved)):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    assert not broken, broken


def test_the_link_check_finds_links_and_slugs_headings_as_github_does(tmp_path):
    assert len(_links(README)) >= 10
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## `a.py`: one's part\n")
    assert _slugs(page) == {"a-title", "apy-ones-part"}


def test_readme_links_every_guide():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    assert {p.resolve() for p in GUIDES} <= linked


# ------------------------------------------------------------------------------------------- records


def _header(path: Path) -> dict[str, str]:
    """The `- key: value` lines that open a record, after its title."""
    lines = path.read_text().splitlines()
    assert lines, f"{_rel(path)} is empty"
    assert lines[0].startswith("# "), f"{_rel(path)} opens with a '# ' title"
    fields = {}
    for line in lines[1:]:
        if not line.strip() and not fields:
            continue
        match = re.match(r"- (\w+): (.+)$", line)
        if not match:
            break
        fields[match.group(1)] = match.group(2)
    return fields


@pytest.mark.parametrize("path", RECORDS, ids=_rel)
def test_each_record_names_its_command_commit_host_and_date(path):
    fields = _header(path)
    assert {"command", "commit", "host", "date"} <= fields.keys(), (_rel(path), fields)
    assert re.fullmatch(r"`python bench/\S+\.py[^`]*`(, then `python bench/\S+\.py[^`]*`)?", fields["command"])
    assert re.match(r"[0-9a-f]{7,40}\b", fields["commit"]), fields["commit"]
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", fields["date"]), fields["date"]


def test_each_measurement_names_its_date_and_host():
    sections = re.split(r"^## ", MEASUREMENTS.read_text(), flags=re.M)[1:]
    assert sections, f"{_rel(MEASUREMENTS)} has no sections"
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"{title}: no date"
        assert "- cited by:" in section, f"{title}: no note cites it"


def _table(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first markdown table whose first column is `first_header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:] if line.startswith("|")]
    end = next((i for i, line in enumerate(lines[start:]) if not line.startswith("|")), len(lines) - start)
    cells = cells[:end]
    return cells[0], cells[2:]


def test_readme_results_quote_the_latest_scoreboard_record():
    results = _section(README.read_text(), "Results")
    record = ROOT / "bench" / "results" / "scoreboard.md"
    fields = _header(record)
    assert fields["command"] in results, "the README names the record's command"
    assert f"date {fields['date']}" in results, "the README gives the record's date"
    assert "bench/results/scoreboard.md" in results, "the README links the record"
    header, rows = _table(results, "configuration")
    record_header, record_rows = _table(record.read_text(), "configuration")
    assert set(header) <= set(record_header), f"columns the record lacks: {set(header) - set(record_header)}"
    # every row of the record, in order, but the buffer-reuse twins (bench/README.md: --reuse-twins)
    main_rows = [row[0] for row in record_rows if "[buffer reuse " not in row[0]]
    assert [row[0] for row in rows] == main_rows, "the README lists the record's rows, in order"
    by_name = {row[0]: dict(zip(record_header, row, strict=True)) for row in record_rows}
    stale = [
        (row[0], column, value, by_name[row[0]][column])
        for row in rows
        for column, value in zip(header, row, strict=True)
        if value != by_name[row[0]][column]
    ]
    assert not stale, f"(row, column, README, record): {stale}"


def test_dates_only_in_records_and_the_results_caption():
    results_caption = re.search(r"^The latest checked-in scoreboard:.*?\n\n", README.read_text(), re.M | re.S)
    assert results_caption, "the README's Results section opens with its caption"
    dated = []
    for path in [README, *GUIDES]:
        text = path.read_text()
        if path == README:
            text = text.replace(results_caption.group(0), "")
        dated += [f"{_rel(path)}: {line}" for line in text.splitlines() if _DATE.search(line)]
    assert not dated, dated


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python -m pip install"))
    assert command.endswith("&& python -m pytest"), command
    assert command in _section(README.read_text(), "The two commands")
