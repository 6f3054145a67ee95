"""torch.compile as an option of `s.model`: the orders that are right for DDP and FSDP, one cache per machine.

    model = s.model(Net(), compile=True)                       # torch.compile's defaults (Inductor)
    model = s.model(Net(), compile={"mode": "max-autotune"})   # any torch.compile keyword arguments

The order: ddpkit compiles your module and then wraps it in DDP (`DDP(torch.compile(net))`), the order
of torch's "where to apply torch.compile" guidance. Measured on 2 CPU ranks in interleaved rounds
(benchmarks/compile_orders.py; docs/performance.md, "torch.compile"), with the same losses in every order:
- compiling outside DDP (`torch.compile(DDP(net))`) lets TorchDynamo's DDPOptimizer split the graph at
  bucket boundaries so that a bucket's all-reduce can overlap the backward of the next. On gloo it was
  slower on the cnn in every round (13.8 vs 12.0 ms) and on gpt within the noise (471-744 vs 580-635
  ms): the CPU all-reduce competes with the backward for the same cores, so there is little to overlap.
  It also compiles one graph per bucket and guards on DDP's Python state.
- compiled autograd with DDP's python reducer (`optimize_ddp="python_reducer"`) traces the backward
  and the all-reduces into one graph: it ran on gloo but was the slowest (cnn 29 vs 19 ms), and it
  needs process-wide Dynamo settings that are not ddpkit's to leave changed.
Inner compilation returns a plain `DistributedDataParallel` whose reducer runs in eager Python, so
everything that talks to DDP works unchanged: `s.accumulate` (no_sync), communication hooks, `s.join`,
static_graph, the sharded step, `ddpkit trace`. ddpkit's CPU SyncBatchNorm works too; Dynamo breaks the
graph at its all-reduce (compiled in pieces, the same statistics). On these CPU ranks compile itself did
not pay (cnn 16 % slower, mlp and gpt equal within the spread); on a GPU it usually does.

With FSDP the order is torchtitan's: each FSDP unit (the blocks `FSDPOptions(blocks=...)` or the size
rule picks; the whole model when no module is a unit of its own) is compiled in place, `block.compile()`,
BEFORE `fully_shard` (`FSDP.wrap_compiling`). FSDP2's hooks (all-gather before a block, reduce-scatter
after) are `torch._dynamo.disable`d, so they run eagerly between the compiled blocks; repeated blocks
share one graph. In place, not `torch.compile(block)`: the module stays itself, so state dict names, DCP
checkpoints and `s.export` gain no `_orig_mod.`.

Compile once per machine, not once per rank and run: before the first compilation ddpkit points
Inductor's caches (FX graph cache, AOTAutograd cache, the compiled C++ kernels) at one directory shared
by the job's ranks and kept between runs: `$TORCHINDUCTOR_CACHE_DIR` when you set it, else
`~/.cache/ddpkit/inductor` (`$XDG_CACHE_HOME` respected). torch keys every entry by the graph, the torch
version and the machine, so a stale entry is never used; a warm cache turns the first step's
compilation into loading (measured in docs/performance.md). torch 2.13 has no config option for this
directory, only the variable, and torch writes it itself: importing `torch._dynamo` sets it to
/tmp/torchinductor_<user> when unset. So that value is torch's, not yours: only a value other than
torch's default counts as set by you. ddpkit sets the variable in this process while the session is
open and puts the previous value back when the session closes.
"""

from __future__ import annotations

import getpass
import inspect
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class CompileOptions:
    """What `s.model(..., compile=...)` asked for: the keyword arguments passed to `torch.compile`."""

    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(self.kwargs) - accepted)
        if unknown:
            raise problem(
                f"compile={dict(self.kwargs)!r} has keys torch.compile does not take: {unknown}",
                f"Use keyword arguments of torch.compile ({', '.join(sorted(accepted))}), or compile=True",
            )

    @classmethod
    def parse(cls, value: bool | Mapping[str, Any] | None) -> CompileOptions | None:
        """None for compile=False/None; the options for True or a dict of torch.compile arguments."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, Mapping):
            return cls(dict(value))
        raise problem(
            f"compile={value!r} is neither True/False nor a dict of torch.compile arguments",
            'Pass compile=True, or e.g. compile={"mode": "max-autotune"}',
        )

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"torch.compile({args or 'defaults'})"


def torch_default_cache_dir() -> str:
    """The directory torch picks, and writes into the variable, if none is set: /tmp/torchinductor_<user>."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # torch moved it: the same rule, written out
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return os.path.abspath(default_cache_dir())


def users_cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """`$TORCHINDUCTOR_CACHE_DIR` if the user set it; None if unset or holding the value torch set itself."""
    env = os.environ if env is None else env
    value = env.get(CACHE_ENV)
    if not value or os.path.abspath(value) == torch_default_cache_dir():
        return None
    return value


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where Inductor's caches go: the user's `$TORCHINDUCTOR_CACHE_DIR`, else ~/.cache/ddpkit/inductor."""
    env = os.environ if env is None else env
    mine = users_cache_dir(env)
    if mine:
        return Path(mine)
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "ddpkit" / "inductor"


def cache_env_restorer() -> Callable[[], None]:
    """A function that puts `$TORCHINDUCTOR_CACHE_DIR` back as it is now (the session calls it on close)."""
    before = os.environ.get(CACHE_ENV)

    def restore() -> None:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before

    return restore


def set_up_cache() -> str:
    """Point this process's Inductor caches at the shared directory (before the first compilation)."""
    path = cache_dir()
    chosen = "yours" if users_cache_dir() else "shared by the job's ranks, kept between runs"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"Inductor cache: {path} is not writable ({err}); torch's default used"
    os.environ[CACHE_ENV] = str(path)
    return f"Inductor cache {path} ({chosen})"


def already_compiled(module: nn.Module) -> bool:
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


CompileBlock = Callable[[nn.Module], None]  # compiles one submodule in place (FSDP: each block)


def apply(
    module: nn.Module,
    options: CompileOptions,
    wrap: Callable[[nn.Module], nn.Module],
    *,
    distributed: bool,
    per_block: Callable[[nn.Module, CompileBlock], tuple[nn.Module, list[str]]] | None = None,
) -> tuple[nn.Module, list[str]]:
    """Compile `module`, then `wrap` it (to the device, DDP when distributed); return it and notes.

    `wrap` is what `s.model` does without compile (the strategy's wrap, with the user's options).
    `per_block`: a strategy that compiles blocks itself while it wraps (FSDP: each unit before
    `fully_shard`, see `compile_in_place`); it gets the module and the function that compiles one
    block, and returns the model and the names of the blocks it compiled.
    """
    if already_compiled(module) and per_block is not None:
        inner = type(getattr(module, "_orig_mod", module)).__name__
        raise problem(
            f"compile= was passed with a module already compiled (torch.compile({inner})); FSDP must shard "
            "the plain module and compiles each block itself before sharding",
            "Pass the uncompiled module (or its factory) with compile=True, or drop compile=",
        )
    if already_compiled(module):
        return wrap(module), ["compile: the module is already compiled (torch.compile); kept as it is"]
    cache = set_up_cache()
    kwargs, scalar = _honour_aten_capability(dict(options.kwargs))
    scalar_note = "compile: ATEN_CPU_CAPABILITY=default: scalar Inductor C++ kernels (cpp.simdlen=1)"
    notes = [scalar_note] if scalar else []
    if per_block is not None:
        model, blocks = per_block(module, lambda block: compile_in_place(block, kwargs))
        shown = ", ".join(b or "the whole model" for b in blocks[:3]) + (", ..." if len(blocks) > 3 else "")
        return model, [
            *notes,
            f"compile: {options.describe()} on each of {len(blocks)} block(s) ({shown}) "
            f"before sharding; {cache}",
        ]
    compiled = torch.compile(module, **kwargs)
    model = wrap(compiled)  # type: ignore[arg-type]  # typed a callable; a module's is an OptimizedModule
    where = ", then wrapped in DDP (DDP(torch.compile(module)))" if distributed else " (one process: no DDP)"
    return model, [*notes, f"compile: {options.describe()} on the module{where}; {cache}"]


def compile_in_place(block: nn.Module, kwargs: Mapping[str, Any]) -> None:
    """`block.compile(...)`: its `__call__` compiled, the module itself kept. Unlike replacing the child
    with `torch.compile(block)` (an OptimizedModule), the state dict's names gain no `_orig_mod.`, so
    checkpoints, `s.export` and DCP's FSDP names stay those of the eager model."""
    block.compile(**kwargs)


def is_compiled_in_place(block: nn.Module) -> bool:
    return getattr(block, "_compiled_call_impl", None) is not None


def _honour_aten_capability(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """ATEN_CPU_CAPABILITY=default: scalar Inductor kernels. torch 2.13 still emits `at::vec` code then,
    which fails to compile ("'at::vec' has not been declared"); simdlen=1 is what the variable asks for."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default" or "mode" in kwargs:
        return kwargs, False
    extra = dict(kwargs.get("options") or {})
    if "cpp.simdlen" in extra:
        return kwargs, False
    return {**kwargs, "options": {**extra, "cpp.simdlen": 1}}, True
