"""The errors a run reports to the user as one line (the CLI prints them without a traceback); no torch here,
so the command line can name them before it imports the engine."""

from __future__ import annotations

import os


class ConfigError(ValueError):
    """A config value that cannot work, with the dotted field name and how to fix it."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field = field_name
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field_name}: {problem}; fix: {fix}")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: one line naming the path, the problem and the fix."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"checkpoint {path}: {problem}; fix: {fix}")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. non-finite steps beyond the allowance); the last checkpoint is kept."""

