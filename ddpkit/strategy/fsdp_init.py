"""Build a model for FSDP so that no rank ever holds all of it, with one process's initial weights.

    model = s.model(Net, strategy="fsdp")                 # a factory: ddpkit builds it shard by shard
    model = s.model(lambda: Net(cfg), strategy="fsdp")

`build(factory)` runs the user's constructor once, on the `meta` device (shapes, no memory), under a
dispatch mode (`ShardedInit`) that executes every operation that gives a tensor values (the modules'
`reset_parameters`, `nn.init.*`, `torch.randn` in a constructor, a later `self.apply(_init_weights)`)
for real, on the CPU, on a full-size temporary of that one tensor, in the order the constructor runs
them. So the CPU generator is consumed exactly as in `torch.manual_seed(seed); Net()` on one process,
and the values are the same bit for bit, by construction. As soon as a parameter is no longer being
written, this rank keeps only its dim-0 chunk (what `fully_shard` gives it) and a checksum of the full
tensor; the temporary is freed. Peak: the rank's shards plus about one full parameter.

Why not DTensor's RNG (`torch.distributed.tensor.random`, torchtitan's `init_weights` on sharded
parameters): it works only on CUDA (Philox offsets; CPU meshes are refused), and even there its values
are not the ones `Net()` draws on one process. Why a factory rather than a meta-built module: once a
module was built on `meta`, its initial values were never drawn and cannot be recovered.

A parameter written again after it was reduced to its chunk (e.g. `weight.mul_(0.5)` in a later init
pass) is rebuilt from all ranks' chunks (one all-gather; every rank runs the same constructor, so the
ranks stay in step); whole-tensor writes (`normal_`, `zero_`, `copy_`) need no gather.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ddpkit.errors import problem
from ddpkit.strategy import adapters, checkpointing, hf

_EMPTY = {"aten::empty", "aten::empty_strided"}  # factories whose values do not matter
_OVERWRITE = {"aten::fill_", "aten::zero_", "aten::copy_"}  # plus every seeded in-place op
_META_NO_OPS = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")  # nn.init returns early on meta
_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Shards:
    """This rank's share of a model's initial state: what `fully_shard` will hold, by name."""

    chunks: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter -> its dim-0 chunk (CPU)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # buffers stay whole under FSDP2
    sums: dict[str, int] = field(default_factory=dict)  # exact checksum of each full tensor
    never_written: list[str] = field(default_factory=list)  # parameters the constructor never wrote

    def checksums(self) -> tuple[list[str], torch.Tensor]:
        names = sorted(self.sums)
        return names, torch.tensor([self.sums[n] for n in names], dtype=torch.int64)


def checksum(t: torch.Tensor) -> int:
    """An exact integer checksum of a tensor's bits (summed as integers, plus a strided sum)."""
    if t.numel() == 0:
        return 0
    bits = t.detach().contiguous().view(_VIEWS[t.element_size()]).reshape(-1)
    return int(bits.sum(dtype=torch.int64)) + 31 * int(bits[::7].sum(dtype=torch.int64))


def chunk(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 chunk of `t`, as `fully_shard` cuts it (torch.chunk; empty past the end)."""
    if t.dim() == 0:
        return t
    pieces = torch.chunk(t, world, dim=0)
    return pieces[rank] if rank < len(pieces) else t.new_empty((0, *t.shape[1:]))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _covers_storage(t: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


class ShardedInit(TorchDispatchMode):
    """Gives meta tensors real values one tensor at a time; keeps registered parameters as chunks."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.full: dict[int, torch.Tensor] = {}  # storage -> its real values (1-D, the storage's elements)
        self.refs: dict[int, StorageWeakRef] = {}
        self.params: dict[int, weakref.ref] = {}  # storage -> the registered (meta) parameter, weakly
        self.stored: dict[int, StorageWeakRef] = {}  # ... and its storage
        self.chunks: dict[int, torch.Tensor] = {}  # parameters no longer written: this rank's chunk
        self.sums: dict[int, int] = {}
        self.peak_full = 0  # bytes of full temporaries alive at once, at most (for the notes and tests)
        self.paused = False  # inside `from_pretrained` (`_as_one_process`): nothing is replayed

    # -- registration (global module hooks, installed by `build`) --------------------------------------
    def on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if isinstance(param, torch.Tensor) and param.is_meta and not self.paused:
            self.params[_key(param)] = weakref.ref(param)
            self.stored[_key(param)] = StorageWeakRef(param.untyped_storage())

    # -- values ----------------------------------------------------------------------------------------
    def _real(self, t: torch.Tensor, overwrite: bool) -> torch.Tensor:
        k = _key(t)
        if k not in self.full:
            if k in self.chunks and not overwrite:
                buf = self._regather(k)
            else:
                buf = torch.empty(
                    t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="cpu"
                )
            self.chunks.pop(k, None)
            self.full[k], self.refs[k] = buf, StorageWeakRef(t.untyped_storage())
        buf = self.full[k]
        if buf.dtype != t.dtype:
            buf = buf.view(t.dtype)
        return buf.as_strided(t.shape, t.stride(), t.storage_offset())

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """The real values behind meta tensor `t` (for torch.nn.init functions that skip meta tensors)."""
        return self._real(t, overwrite=_covers_storage(t))

    def _regather(self, k: int) -> torch.Tensor:
        """A parameter's full values back from every rank's chunk (the ranks run the same code)."""
        param: Any = self.params[k]()  # live: the caller holds it
        mine = self.chunks[k]
        if self.world == 1:
            return mine.reshape(-1).clone()
        if not dist.is_initialized():
            raise problem(
                "a parameter was written again after it was sharded, and there is no process "
                "group to gather it back",
                "Build the model inside ddpkit.session()",
            )
        rows = [c.shape[0] for c in torch.chunk(torch.empty(param.shape[0], 0, device="cpu"), self.world)]
        rows += [0] * (self.world - len(rows))
        most = max(rows)
        padded = torch.zeros((most, *param.shape[1:]), dtype=param.dtype, device="cpu")
        padded[: mine.shape[0]] = mine
        # over every rank (they all run this constructor; the shard groups are not formed yet): global
        # ranks 0..world-1 hold chunks 0..world-1 (1-D: everyone; HSDP: the first replica group)
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, padded)
        return torch.cat([p[:r] for p, r in zip(parts[: self.world], rows, strict=True)]).reshape(-1)

    def _flush(self, keep: set[int]) -> None:
        """Reduce every parameter not written by the current operation to this rank's chunk."""
        live = [k for k in self.full if k in self.params and self.params[k]() is not None]
        for k in [k for k in live if k not in keep]:
            whole = self._real(self.params[k](), overwrite=False)  # type: ignore[arg-type]  # live: above
            self.sums[k] = checksum(whole)
            self.chunks[k] = chunk(whole, self.rank, self.world).clone()
            del self.full[k], self.refs[k]

    def _prune(self) -> None:
        for k in [k for k, ref in self.refs.items() if ref.expired()]:
            del self.full[k], self.refs[k]
        gone = [k for k, ref in self.params.items() if ref() is None and self.stored[k].expired()]
        for k in gone:  # a parameter replaced (by a tied one): its chunk is nobody's (GPT-2's head: 77 MiB)
            del self.params[k], self.stored[k]
            self.chunks.pop(k, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._prune()
        flat, spec = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        metas = [a for a in tensors if a.is_meta]
        keys = {_key(t) for t in metas}
        name = func._schema.name
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if metas:
            needs_values = (
                any(k in self.full or k in self.chunks for k in keys)  # reads or writes a tensor with values
                or seeded  # draws from the generator: must draw as one process would
                or func._schema.is_mutable  # writes values into a meta tensor
                or len(metas) < len(tensors)  # real values flowing into a meta tensor
            )
        else:  # real tensors only (run as they are), or made on meta: randn, zeros, arange, .to("meta")
            needs_values = name not in _EMPTY and _on_meta(flat)
        if not needs_values:
            return func(*args, **kwargs)
        first = args[0] if args else None
        written = (
            bool(func._schema.arguments)
            and func._schema.arguments[0].alias_info is not None
            and (func._schema.arguments[0].alias_info.is_write)
        )
        overwrite = (
            isinstance(first, torch.Tensor)
            and first.is_meta
            and written
            and (seeded or name in _OVERWRITE)
            and _covers_storage(first)
        )
        real = [
            self._real(a, overwrite=overwrite and a is first)
            if isinstance(a, torch.Tensor) and a.is_meta
            else torch.device("cpu")
            if isinstance(a, torch.device) and a.type == "meta"
            else a
            for a in flat
        ]
        real_args, real_kwargs = tree_unflatten(real, spec)
        real_out = func(*real_args, **real_kwargs)
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(real_out)):
            return real_out  # e.g. `.item()`: a number, which meta tensors cannot give
        out = func(*args, **kwargs)  # the meta result: shapes, strides, and which storage it views
        for m, r in zip(tree_leaves(out), tree_leaves(real_out), strict=True):
            if isinstance(m, torch.Tensor) and m.is_meta:
                keys.add(_key(m))
                if _key(m) not in self.full:  # a new tensor: keep its values
                    self._real(m, overwrite=True).copy_(r)
        self.peak_full = max(self.peak_full, sum(b.numel() * b.element_size() for b in self.full.values()))
        self._flush(keys)
        return out

    def finish(self, module: nn.Module) -> Shards:
        """This rank's chunks, the buffers and the checksums, by name."""
        self._flush(set())
        self._prune()
        shards = Shards()
        with torch.no_grad():
            for name, p in module.named_parameters():
                if not p.is_meta:  # the factory built it for real (an explicit device): cut it here
                    shards.sums[name] = checksum(p)
                    shards.chunks[name] = chunk(p.detach().cpu(), self.rank, self.world).clone()
                    continue
                k = _key(p)
                if k in self.full:  # values given by `p.data = t` (HF pads a tied bias so): no op to see
                    whole = self._real(p, overwrite=False)
                    self.sums[k] = checksum(whole)
                    self.chunks[k] = chunk(whole, self.rank, self.world).clone()
                shards.sums[name] = self.sums.get(k, 0)
                mine = self.chunks.get(k)
                if mine is None:
                    shards.never_written.append(name)
                shards.chunks[name] = (
                    mine
                    if mine is not None
                    else chunk(torch.zeros(p.shape, dtype=p.dtype), self.rank, self.world)
                )  # never written: uninitialised in one process too; zeros here
            for name, b in module.named_buffers():
                if b.is_meta:
                    value = (
                        self._real(b, overwrite=False).clone()
                        if _key(b) in self.full
                        else (torch.zeros(b.shape, dtype=b.dtype))
                    )
                else:
                    value = b.detach().cpu().clone()
                shards.buffers[name], shards.sums[f"buffer:{name}"] = value, checksum(value)
        self.full.clear()
        self.refs.clear()
        return shards


def _named(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Names as `state_dict` gives them: without activation checkpointing's wrapper segment, so the
    shards built before the wrappers were applied match the wrapped module's tensors."""
    return ((checkpointing.plain_name(n), t) for n, t in items)


def _on_meta(flat: list[Any]) -> bool:
    return any(isinstance(a, torch.device) and a.type == "meta" for a in flat)


class _Constants(TorchFunctionMode):
    """`torch.tensor([0.5, 2.0])` on meta never reaches the dispatcher with its data: made on the CPU,
    then moved to meta through `ShardedInit`, which keeps the values."""

    _MAKERS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func in self._MAKERS and (device is None or torch.device(device).type == "meta"):
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _init_functions(mode: ShardedInit) -> Iterator[None]:
    """torch.nn.init's functions that return early on a meta tensor run on its real values instead.

    Swapped in `torch.nn.init` for the duration of `build` only (modules call them as `nn.init.x_`)."""
    originals = {name: getattr(nn.init, name) for name in _META_NO_OPS}

    def on_values(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and not mode.paused:
                fn(mode.values(tensor), *args, **kwargs)
                return tensor
            return fn(tensor, *args, **kwargs)

        return run

    for name, fn in originals.items():
        setattr(nn.init, name, on_values(fn))
    try:
        with hf.real_init(on_values, _META_NO_OPS):  # HF models: their own init, not skipped on meta
            yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


@contextlib.contextmanager
def _as_one_process(mode: ShardedInit) -> Iterator[None]:
    """Run a span of the factory exactly as one process would, outside every mode `build` set: for
    `from_pretrained` in a factory (e.g. the base of a PEFT model). One process builds the model on
    `meta` there (no values: its `_init_weights` draws nothing) and loads the file into real tensors;
    replayed under `ShardedInit`, those draws would be made for real and consume the generator, so the
    adapters drawn after it (LoRA's A matrices) would start from other values than one process's.
    Costs the loaded model whole on every rank (its tensors are cut when the build ends); for a large
    base, build it from its config and pass `weights=` (each rank reads only its rows)."""
    from torch.utils._python_dispatch import _disable_current_modes

    functions = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    mode.paused = True
    try:
        with _disable_current_modes():
            yield
    finally:
        mode.paused = False
        for m in reversed(functions):
            torch._C._push_on_torch_function_stack(m)


def build(factory: Callable[[], nn.Module], rank: int, world: int) -> tuple[nn.Module, Shards, int]:
    """Run `factory` on the meta device; the meta module, this rank's shards, the peak temporary bytes."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    mode = ShardedInit(rank, world)
    handle = register_module_parameter_registration_hook(mode.on_parameter)
    try:
        with (
            torch.device("meta"),
            mode,
            _Constants(),
            _init_functions(mode),
            adapters.cast_on_meta(),
            hf.loading_as_is(functools.partial(_as_one_process, mode)),
        ):
            module = factory()
    finally:
        handle.remove()
    if not isinstance(module, nn.Module):
        raise problem(
            f"the model factory returned a {type(module).__name__}, not an nn.Module",
            "Pass a class or a function that builds the model, e.g. s.model(Net) or "
            "s.model(lambda: Net(cfg))",
        )
    shards = mode.finish(module)
    hf.check_written(module, shards.never_written)
    return module, shards, mode.peak_full


def cut(module: nn.Module, rank: int, world: int) -> Shards:
    """A model the user built whole: this rank's chunks of it, then the module moved to `meta`, so the
    full tensors are freed (if nothing else holds them) and only the shards are ever put on a device."""
    shards = Shards()
    with torch.no_grad():
        for name, p in _named(module.named_parameters()):
            shards.sums[name] = checksum(p)
            shards.chunks[name] = chunk(p.detach().cpu(), rank, world).clone()
        for name, b in _named(module.named_buffers()):
            shards.buffers[name] = b.detach().cpu().clone()
            shards.sums[f"buffer:{name}"] = checksum(b)
    tied = hf.tied_owners(module)
    module.to("meta")  # makes one new parameter per module: tied ones (lm_head.weight) would come apart
    for owners in tied.values():
        (first, attr), rest = owners[0], owners[1:]
        shared = module.get_submodule(first)._parameters[attr]
        for name, other in rest:
            setattr(module.get_submodule(name), other, shared)  # tied again, as the user built it
    return shards


def fill(module: nn.Module, shards: Shards, device: torch.device) -> None:
    """After `fully_shard` on the meta module: allocate only the local shards on `device`, copy ours in."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in _named(module.named_parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            mine = shards.chunks.pop(name)  # freed as soon as copied: empty blocks cost no memory until
            # written (mmap), so the rank's peak is its shards once, not the shards twice
            if local.numel() != mine.numel():
                raise problem(
                    f"the shard of {name!r} holds {local.numel()} elements on this rank, ddpkit cut "
                    f"{mine.numel()} (fully_shard sharded it another way than dim 0)",
                    "Report this with the model; as a workaround build the model whole and pass the module",
                )
            if mine.numel():
                local.copy_(mine.reshape(local.shape))
        for name, b in _named(module.named_buffers()):
            b.copy_(shards.buffers[name])
