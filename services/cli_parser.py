"""The CLI's argument parser: argparse's, with a usage error on one line.

The README promises that a bad flag, path or config key prints one line `mariana ...:
error: ...` and exits 2. argparse's own errors printed the whole usage block first (13 lines
for `mariana train --format parquetx`); the usage stays one `--help` away.
"""
from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose usage errors are one line on stderr, exit code 2.
    Sub-commands' parsers are of the same class (add_subparsers takes the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):
        """A sub-command's parser refuses what it does not know itself: argparse hands it up to
        the top parser, whose error pointed at `mariana --help`, which lists no option of it."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        if self._subparsers is None:
            self._refuse_empty(namespace)
        return namespace, extras

    def _refuse_empty(self, namespace) -> None:
        """An option given an empty value (`--test-data "$TEST"` with TEST unset) is an error:
        `--test-data ''`, `--config ''` or `--init-from ''` read as the option left out, and
        the job ran without what was asked for, with exit code 0."""
        for action in self._actions:
            if not action.option_strings or action.default == "":
                continue
            value = getattr(namespace, action.dest, None)
            if value == "" or (isinstance(value, list) and "" in value):
                self.error(f"{'/'.join(action.option_strings)} is empty: give it a value, or leave the option out")
