"""``deepspeed.ops``: DeepSpeed's optimizer classes, mapped onto zeroengine's."""
from . import adam  # noqa: F401
