"""Every error a user can fix. Each message names the fix; the CLI prints it as one line, exit 2."""

from __future__ import annotations


class FitoneError(Exception):
    """Base of all user-facing errors: caught by the CLI and printed without a traceback."""

    exit_code = 2


class ConfigError(FitoneError):
    """An option or recipe value that cannot work (bad size, conflicting options, unknown key)."""


class DataError(FitoneError):
    """A data file that is missing, unreadable, empty or malformed."""


class ModelError(FitoneError):
    """A model that cannot be found, loaded or built."""


class RunDirError(FitoneError):
    """An output directory that would be overwritten, or a resume with nothing to resume."""


class MemoryBudgetError(FitoneError):
    """Not enough GPU or host memory for what was asked, even at the smallest size."""


class TrainingAborted(FitoneError):
    """Training stopped early (signal, NaN streak, host-memory watch); a checkpoint was kept."""

    exit_code = 1


class DeviceError(FitoneError):
    """The asked-for device or precision is not available on this machine."""
