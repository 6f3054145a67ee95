"""Moved to `ddpkit.parallel.comm_hooks` (what strategies are built from sits below them); this path keeps
working for one release, with a DeprecationWarning, and is the same module object."""

import sys
import warnings

from ddpkit.parallel import comm_hooks as _moved

warnings.warn(
    "ddpkit.step.comm_hooks moved to ddpkit.parallel.comm_hooks; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
