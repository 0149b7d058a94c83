"""Every ``pipeline ...`` command line in the README's shell blocks names a real command and parses
with that command's own flags (a checked list kept by the test: a renamed flag or command fails
here), and the Python client example is valid Python naming the headers the proxy reads."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from pipeline.cli import COMMANDS, add_common_arguments

README = Path(__file__).resolve().parents[2] / "README.md"


def shell_lines() -> list[str]:
    """``pipeline ...`` lines of the README's bash blocks (continuations joined, comments cut)."""
    text = README.read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|", line):
                cmd = part.split(" # ")[0].strip()
                cmd = re.sub(r"^(\.venv/bin/)", "", cmd)
                if cmd.startswith("pipeline "):
                    out.append(cmd)
    return out


LINES = shell_lines()


def test_the_readme_shows_commands():
    assert len(LINES) >= 10, LINES


@pytest.mark.parametrize("line", LINES)
def test_each_readme_command_parses(line):
    argv = shlex.split(line)[1:]
    name = argv[0]
    assert name in COMMANDS, f"README names an unknown command: {line}"
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"pipeline {name}", exit_on_error=False)
    module.add_arguments(parser)
    add_common_arguments(parser)
    try:
        parser.parse_args(argv[1:])
    except (argparse.ArgumentError, SystemExit) as e:
        pytest.fail(f"README command does not parse: {line}: {e}")


def test_the_python_client_example_is_valid_and_uses_the_proxy_headers():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    client = next(b for b in blocks if "OpenAI(" in b)
    ast.parse(client)
    assert "base_url=" in client and "X-Session-Id" in client and "model=" in client
