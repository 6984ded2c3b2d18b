"""The README's map of the trainer ("Reading the file") stays true to the file."""

import re

from conftest import ROOT, SCRIPT

import ppo_atari_multigpu as ppo


def file_map():
    text = (ROOT / "README.md").read_text()
    start = text.index("### Reading the file")
    return text[start : text.index("To delete a feature", start)]


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
