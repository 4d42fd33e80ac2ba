"""The exception types that cross layers: one module, below every other, so that a layer catches another's
failure without importing it. Each message names what failed (the field, file, stage, generator or version)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class GeneratorFailed(RuntimeError):
    """A generator failed for good (start-up error, restarts exhausted, or a remote server lost)."""


class StageTimeout(TimeoutError):
    """A pipeline stage did not answer in time. The message names the stage."""


class WeightTransportError(RuntimeError):
    """A transport could not deliver a version (besides `OSError`s such as a full `shm_dir`); names the stage."""


class RewardError(RuntimeError):
    """A reward function failed or returned an unusable value; the message names it and the prompt."""


class FieldError(ValueError):
    """A serialised message is malformed; the message names the message kind and the field."""


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message names the column or row."""


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the file and the problem."""
