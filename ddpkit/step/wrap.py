"""Moved: `DDPOptions` to `ddpkit.strategy` (`strategy.ddp_options`), DDP's construction to
`ddpkit.strategy.ddp`, `unwrap` / `ddp_of` to `ddpkit.parallel.modules`, the BatchNorm conversion to
`ddpkit.parallel.syncbn`. This path keeps working for one release, with a DeprecationWarning."""

import importlib
import warnings

_MOVED = {
    "DDPOptions": "ddpkit.strategy.ddp_options",
    "wrap_model": "ddpkit.strategy.ddp",
    "unwrap": "ddpkit.parallel.modules",
    "ddp_of": "ddpkit.parallel.modules",
    "convert_batchnorm": "ddpkit.parallel.syncbn",
    "has_batchnorm": "ddpkit.parallel.syncbn",
}


def __getattr__(name: str) -> object:
    if name not in _MOVED:
        raise AttributeError(f"module 'ddpkit.step.wrap' has no attribute {name!r}")
    warnings.warn(
        f"ddpkit.step.wrap.{name} moved to {_MOVED[name]}.{name}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
