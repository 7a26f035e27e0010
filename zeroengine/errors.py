"""Every exception (and the one warning) zeroengine raises, in one place, all importable from
``zeroengine``. Each is also an instance of the builtin a caller would catch without knowing
zeroengine (a bad config is a ValueError, a failed collective a RuntimeError), and of
``ZeroEngineError``, to catch whatever the engine refused or could not do.

The modules that raise them import them from here; each message names the problem and the fix
(the config key, the rank, the parameter, the file)."""
from __future__ import annotations


class ZeroEngineError(Exception):
    """Base of every error zeroengine raises itself."""


# -- configuration and launch ------------------------------------------------------------------
class ConfigError(ZeroEngineError, ValueError):
    """A config that cannot be used; the message names the key path and the fix."""


class ConfigNotice(UserWarning):
    """A config key accepted with no effect here, an alias, or an ignored unknown key."""


class LaunchError(ZeroEngineError, ValueError):
    """A launch that cannot be done as asked: the message names the flag."""


class OptimizerKindError(ZeroEngineError, TypeError):
    """The optimizer cannot be sharded, or zeroengine could not tell how."""


# -- ranks and collectives ---------------------------------------------------------------------
class RankMismatchError(ZeroEngineError, RuntimeError):
    """Ranks built different models, configs or zeroengine versions."""


class CollectiveError(ZeroEngineError, RuntimeError):
    """A collective that could not complete: it timed out waiting for another rank, or a peer
    went away. The message names the operation, what it carried and the step."""


class RankDivergenceError(ZeroEngineError, RuntimeError):
    """Stage-3 ranks were about to gather different parameters: they run different code."""


# -- the training loop -------------------------------------------------------------------------
class ShardedParameterAccessError(ZeroEngineError, RuntimeError):
    """A stage-3 partitioned parameter was read where its values are not gathered."""


class ParameterReplacedError(ZeroEngineError, RuntimeError):
    """A parameter the engine manages was replaced or re-pointed after initialize()."""


class MixedStepError(ZeroEngineError, RuntimeError):
    """engine.step() and the optimizer's own step() used so that a step cannot be counted."""


class LossScaleFloorError(ZeroEngineError, RuntimeError):
    """Gradients overflow even at the minimum loss scale."""


class NonFiniteGradientError(ZeroEngineError, FloatingPointError):
    """A step's gradient held inf/NaN and the config's on_nonfinite is 'raise'."""


# -- weights and checkpoints -------------------------------------------------------------------
class WeightsError(ZeroEngineError, ValueError):
    """The weight files cannot serve the model: names the file or key and what to do."""


class CheckpointError(ZeroEngineError, RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names the file."""


class UnsafeOrUnreadable(ZeroEngineError, ValueError):
    """The file is not a torch.save archive this reader takes, or pickles something it refuses."""


# -- the DeepSpeed API -------------------------------------------------------------------------
class NotInZeroengine(ZeroEngineError, AttributeError):
    """A DeepSpeed name zeroengine.deepspeed does not provide (an AttributeError, so that
    ``hasattr`` and ``getattr(..., default)`` probes keep working)."""


__all__ = ["ZeroEngineError", "ConfigError", "ConfigNotice", "LaunchError",
           "OptimizerKindError", "RankMismatchError", "CollectiveError", "RankDivergenceError",
           "ShardedParameterAccessError", "ParameterReplacedError", "MixedStepError",
           "LossScaleFloorError", "NonFiniteGradientError", "WeightsError", "CheckpointError",
           "UnsafeOrUnreadable", "NotInZeroengine"]
