"""The README stays true: its map of the trainer, the files it names, the commands it shows."""

import dataclasses
import re
import shlex

import tyro
from conftest import ROOT, SCRIPT

import ppo_atari_multigpu as ppo

README = (ROOT / "README.md").read_text()


def file_map():
    start = README.index("The map, in order")
    return README[start : README.index("To delete a feature", start)]


def snippets(text=None):
    """The shell text the README shows: each fenced block's lines (with `\\` continuations
    joined) and each inline code span (which may wrap over lines)."""
    text = README if text is None else text
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    out = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    rest = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return out + [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", rest)]


def commands(program, text=None):
    """The arguments after `program` in every snippet that runs it."""
    found = []
    for snippet in snippets(text):
        if program in snippet.split():
            tail = snippet.split(program, 1)[1].split("#")[0]
            found.append(shlex.split(tail.replace("[", "").replace("]", "")))
    return found


def test_readme_file_map_names_only_functions_and_classes_the_trainer_defines():
    names = set(re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)(?:\(|`)", file_map()))
    names -= {"GradScaler", "step"}  # torch's class; RankEnvs' method, spelt with its arguments
    assert len(names) > 20
    missing = sorted(n for n in names if not hasattr(ppo, n))
    assert not missing, f"README names what the trainer lacks: {missing}"


def test_readme_file_map_lists_every_block_banner_of_the_trainer():
    banners = re.findall(r"^# ---- ([A-Z][A-Z -]+[A-Z])", SCRIPT.read_text(), re.MULTILINE)
    assert len(banners) >= 9
    missing = [b for b in banners if f"{b} (" not in " ".join(file_map().split())]
    assert not missing, f"blocks the README's map leaves out: {missing}"


def test_every_file_the_readme_names_exists():
    paths = set(re.findall(r"(?<![\w/.])((?:benchmark|tests|\.ci)/[\w./-]*\w/?)", README))
    paths |= set(re.findall(r"(?<![\w/])(requirements[\w-]*\.txt|pyproject\.toml)", README))
    assert len(paths) > 15, paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"the README names files that do not exist: {missing}"


def test_every_trainer_command_in_the_readme_parses():
    runs = commands("ppo_atari_multigpu.py")
    assert len(runs) >= 8, runs
    for args in runs:
        try:
            tyro.cli(ppo.Args, args=args)
        except SystemExit as e:  # --help exits 0
            assert e.code == 0, f"the README shows a trainer command that does not parse: {args}"


def trainer_flags():
    flags = set()
    for f in dataclasses.fields(ppo.Args):
        if "Suppress" in str(f.type):
            continue
        flags.add("--" + f.name.replace("_", "-"))
        if f.type is bool:
            flags.add("--no-" + f.name.replace("_", "-"))
    return flags


def test_every_flag_in_the_readme_flag_table_is_a_trainer_flag():
    section = README[README.index("## Flags") : README.index("### How local")]
    shown = set()
    for row in section.splitlines():
        if row.startswith("| `--"):
            shown |= set(re.findall(r"`(--[a-z-]+)`", row.split(" | ")[0]))
    assert len(shown) > 30, shown
    unknown = sorted(shown - trainer_flags())
    assert not unknown, f"the README's flag table shows flags the trainer lacks: {unknown}"


def test_every_benchmark_command_in_the_readme_uses_flags_its_script_has():
    scripts = sorted(set(re.findall(r"python (benchmark/\w+\.py)", README)))
    assert len(scripts) >= 2, scripts
    for script in scripts:
        source = (ROOT / script).read_text()
        runs = commands(script)
        assert runs, script
        for args in runs:
            unknown = [a for a in args if a.startswith("--") and f'"{a}"' not in source]
            assert not unknown, f"{script} has no {unknown} (README: {args})"


def test_every_readme_section_the_code_cites_is_a_heading():
    headings = set(re.findall(r"^#+ (.+)$", README, re.MULTILINE))
    cited = set()
    for path in [SCRIPT, *ROOT.glob("tests/*.py"), *ROOT.glob("benchmark/*.py")]:
        cited |= set(re.findall(r'README "([A-Z][^"]*)"', path.read_text()))
    assert cited, "no citation found: the pattern is broken"
    missing = sorted(c for c in cited if c not in headings)
    assert not missing, f"sections cited in the code but not in the README: {missing}"
