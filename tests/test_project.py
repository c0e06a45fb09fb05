"""Project wiring: CI runs the README's commands, the package ships its type marker."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick)


def test_quick_start_has_exactly_two_commands():
    commands = readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert commands[0].endswith("multiattn conformance")
    assert commands[1].endswith("pytest")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_package_ships_py_typed():
    assert (ROOT / "multiattn" / "py.typed").exists()
    assert 'multiattn = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
