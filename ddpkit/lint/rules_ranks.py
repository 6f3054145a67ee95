"""Rules about what each rank does: DDP006 (saving), DDP007 (printing), DDP008 (seeds), DDP009 (devices).

ddpkit's own calls are the fixes, never findings: `s.save` writes once per file (or per shard),
`s.print` prints on global rank 0, `session(seed=...)` seeds all ranks alike and gives each rank its
own stream after `s.model`, and `s.device` is the rank's device.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.lint.rule import Rule
from ddpkit.lint.script import Script, exits, is_const, kwarg, last, rankish, unparse

Found = Iterator[tuple[ast.AST, str]]
_SEEDERS = ("manual_seed", "manual_seed_all", "seed_everything", "set_seed")
_CUDA_N = re.compile(r"^cuda:\d+$")
_GUARDS_DEVICE = re.compile(r"cuda|is_available|accelerator|gpu|device", re.IGNORECASE)


def save_every_rank(script: Script) -> Found:
    if not script.multi_rank:
        return
    for call in script.calls():
        target = call.args[1] if len(call.args) > 1 else kwarg(call, "f")
        if script.callee(call) != "torch.save" or (target is not None and rankish(target)):
            continue  # a file per rank (`f"rank{rank}.pt"`) is no race
        if not script.guarded(call):
            yield call, f"every rank writes {unparse(target) or 'the file'} (the same file, at the same time)"


def _looks_like_metric(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else ""
        if re.search(r"loss|acc", name, re.IGNORECASE) or name == "item":
            return True
    return False


def print_every_rank(script: Script) -> Found:
    """A loss or accuracy printed by every rank, untagged: N lines, each a rank's local value that reads
    like the global one (or, after an all_reduce, the same line N times). Prints that name their rank
    are deliberate and never reported. A message built first (`msg = "...".format(loss)`) is read."""
    if not script.sets_up_ranks:
        return  # the group is set up elsewhere, where print may be made rank-0-only
    for call in script.calls():
        if not (isinstance(call.func, ast.Name) and call.func.id == "print"):
            continue
        message = ast.Tuple(elts=[script.value_of(a) for a in call.args], ctx=ast.Load())  # type: ignore[misc]
        if not _looks_like_metric(message) or rankish(message) or "getpid" in unparse(message):
            continue
        if script.guarded(call):
            continue
        scope = script.scope(call)
        text = unparse(call.args[0]) if call.args else ""
        if any("reduce" in script.callee(c) or "gather" in script.callee(c) for c in script.calls(scope)):
            yield call, f"every rank prints the same combined `{text}`: each line N times"[:200]
        else:
            yield call, f"every rank prints its own `{text}`"[:200]


def _no_broadcast(script: Script, call: ast.Call) -> bool:
    """A wrap that does not copy rank 0's weights: FSDP, fully_shard, s.model(..., strategy="fsdp")."""
    if script.session_call(call, "model"):
        strategy = kwarg(call, "strategy")
        return strategy is not None and not is_const(strategy, "ddp")
    return last(script.callee(call)) in ("FullyShardedDataParallel", "FSDP", "fully_shard")


def _shard_after(script: Script, node: ast.AST) -> ast.Call | None:
    """The first non-broadcasting wrap that runs after `node`: in its function, or inside a call
    into the file's own functions made after it."""
    for call in sorted(script.calls(script.scope(node)), key=lambda c: (c.lineno, c.col_offset)):
        if script.after(call, node) and (_no_broadcast(script, call) or _reaches_shard(script, call, set())):
            return call
    return None


def _reaches_shard(script: Script, call: ast.Call, seen: set) -> bool:
    for fn in script.local_callees(call):
        if fn in seen:
            continue
        seen.add(fn)
        if any(_no_broadcast(script, c) or _reaches_shard(script, c, seen) for c in script.calls(fn)):
            return True
    return False


def seeds(script: Script) -> Found:
    """Per-rank seeds matter where nothing copies rank 0's weights (DDP does, at wrap time, so a
    per-rank seed before DDP(...) is harmless and not reported) and for ddpkit's session, whose seed
    also orders the loader's shuffle, which must be the same on every rank."""
    if not script.multi_rank:
        return
    reported: set[ast.If] = set()  # one finding per rank test, however many generators it seeds
    for call in sorted(script.calls(), key=lambda c: (c.lineno, c.col_offset)):
        name = script.callee(call)
        value = None
        if last(name) in _SEEDERS or name in ("random.seed", "numpy.random.seed"):
            value = call.args[0] if call.args else kwarg(call, "seed")
        elif script.uses_ddpkit and name in ("ddpkit.session", "ddpkit.session.session"):
            value = kwarg(call, "seed")
        if value is None:
            continue
        if rankish(value) and name.startswith("ddpkit.session"):
            yield call, f"`seed={unparse(value)}` differs per rank: different initial weights and data shards"
        elif rankish(value):
            shard = _shard_after(script, call)
            if shard is not None:
                wrap = f"`{unparse(shard.func)}` on line {shard.lineno}"
                yield call, f"`{unparse(call)}` differs per rank, before {wrap}"
        elif (guard := _only_on_some_ranks(script, call)) is not None and guard not in reported:
            reported.add(guard)
            yield call, f"`{unparse(call)}` runs under a rank test: the other ranks stay unseeded"


def _only_on_some_ranks(script: Script, call: ast.Call) -> ast.If | None:
    """The rank test (`if rank == 0:`) the seed runs under, when its else branch seeds nothing."""
    child: ast.AST = call
    for a in script.ancestors(call):
        if isinstance(a, ast.If) and child in a.body and rankish(a.test):
            seeded = any(last(script.callee(c)) in _SEEDERS for s in a.orelse for c in script.calls(s))
            return None if seeded else a
        if isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        child = a
    return None


def hard_coded_cuda(script: Script) -> Found:
    if not script.multi_rank:
        return
    picks_device = (
        any(
            last(script.callee(c)) in ("set_device", "set_device_index", "device_index")
            for c in script.calls()
        )
        or script.mentions("CUDA_VISIBLE_DEVICES")
        or not script.sets_up_ranks
    )  # then maybe set elsewhere
    bare = []
    for call in script.calls():
        fixed = _fixed_index(script, call)
        if fixed:
            yield call, f"`{fixed}` puts every rank on the same GPU"
        elif (
            _bare_cuda(script, call)
            and script.wraps
            and (script.session_names or not picks_device)
            and not _under_device_test(script, call)
        ):
            bare.append(call)
    if bare:  # one cause (nothing selects the rank's GPU), one finding: the first, naming the others
        first = min(bare, key=lambda c: (c.lineno, c.col_offset))
        why = "fails in ddpkit's CPU modes" if script.session_names else "every rank lands on cuda:0"
        more = sorted({c.lineno for c in bare} - {first.lineno})
        also = f" (also line{'s' * (len(more) > 1)} {', '.join(map(str, more))})" if more else ""
        yield first, f"`{unparse(first)}` picks the current GPU: {why}{also}"
    for node in ast.walk(script.tree):
        # `device = "cuda:0"`, also annotated (`device: str = "cuda:0"`, a dataclass config's default)
        target = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        named_device = any("device" in unparse(t).lower() for t in target)
        if named_device and _cuda_n(node.value):  # type: ignore[attr-defined]
            yield node, f"`{unparse(node)}` puts every rank on the same GPU"


def _cuda_n(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_CUDA_N.match(node.value))


def _fixed_index(script: Script, call: ast.Call) -> str:
    """`.cuda(0)`, `"cuda:0"` as an argument, `torch.device("cuda", 0)`, `device_ids=[0]`."""
    f, name = call.func, script.callee(call)
    if (
        isinstance(f, ast.Attribute)
        and f.attr == "cuda"
        and call.args
        and isinstance(call.args[0], ast.Constant)
    ):
        return unparse(call)
    if any(_cuda_n(a) for a in [*call.args, *(k.value for k in call.keywords)]):
        return unparse(call)
    if last(name) == "device" and len(call.args) == 2 and isinstance(call.args[1], ast.Constant):
        return unparse(call)
    ids = kwarg(call, "device_ids")
    if (
        script.is_wrap(call)
        and isinstance(ids, ast.List)
        and any(isinstance(e, ast.Constant) for e in ids.elts)
    ):
        return f"device_ids={unparse(ids)}"
    return ""


def _bare_cuda(script: Script, call: ast.Call) -> bool:
    """`x.cuda()`, `x.to("cuda")`, `torch.device("cuda")`: the current GPU, whichever that is."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "cuda" and not call.args and not call.keywords:
        return unparse(f.value) not in ("torch", "torch.backends")
    if last(script.callee(call)) == "device":  # torch.device("cuda"); not torch.device("cuda", local_rank)
        return len(call.args) == 1 and is_const(call.args[0], "cuda") and kwarg(call, "index") is None
    args = [*call.args, *(k.value for k in call.keywords if k.arg == "device")]
    return isinstance(f, ast.Attribute) and f.attr == "to" and any(is_const(a, "cuda") for a in args)


def _under_device_test(script: Script, node: ast.AST) -> bool:
    """Runs only with a GPU: under `if torch.cuda.is_available():`, or after `assert ...cuda...`,
    `if not ...cuda...: return/raise` or a `cuda_only()`-like call at the top of its function."""
    if any(
        isinstance(a, ast.If | ast.IfExp) and _GUARDS_DEVICE.search(unparse(a.test))
        for a in script.ancestors(node)
    ):
        return True
    scope = script.scope(node)
    for stmt in getattr(scope, "body", []):
        if stmt.lineno >= node.lineno:  # type: ignore[attr-defined]
            break
        if isinstance(stmt, ast.Assert) and _GUARDS_DEVICE.search(unparse(stmt.test)):
            return True
        if isinstance(stmt, ast.If) and _GUARDS_DEVICE.search(unparse(stmt.test)) and exits(stmt.body):
            return True
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(call, ast.Call) and re.search(r"cuda|gpu", last(script.callee(call)), re.IGNORECASE):
            return True
    return False


RULES = (
    Rule(
        "DDP006",
        "save-every-rank",
        "torch.save on every rank",
        "Every rank writes the same file at the same time: torn or corrupt checkpoints, N times the I/O. "
        "ddpkit's s.save is not reported (one writer per file, atomic).",
        "torch.save on global rank 0 only (`if dist.get_rank() == 0:`); with ddpkit, s.save(...) on every "
        "rank (it writes each file once)",
        save_every_rank,
    ),
    Rule(
        "DDP007",
        "print-every-rank",
        "a loss or metric printed on every rank",
        "N lines per step, each one rank's local value that reads like the global one. Prints that name "
        "their rank, and ddpkit's s.print, are not reported.",
        "s.print(...) with ddpkit, or `if rank == 0:` after an all_reduce of the value",
        print_every_rank,
    ),
    Rule(
        "DDP008",
        "seed-per-rank",
        "a per-rank seed where ranks must agree, or a seed on some ranks only",
        "FSDP/fully_shard copy no weights between ranks, so a seed that differs per rank before them gives "
        "each rank other initial weights; ddpkit.session(seed=...) also orders the loader's shuffle, which "
        "must agree across ranks; a seed under a rank test leaves the other ranks unseeded. A per-rank seed "
        "before DDP(...) (which broadcasts rank 0's weights) or after wrapping is fine and not reported.",
        "seed every rank alike before building the model (ddpkit: session(seed=0)); add the rank later",
        seeds,
    ),
    Rule(
        "DDP009",
        "hard-coded-gpu",
        "a hard-coded GPU",
        "`cuda:0`, `.cuda(0)` or `device_ids=[0]` put every rank on one GPU (NCCL errors, one GPU's memory "
        "for all); a bare `.cuda()` does too when nothing selects the rank's GPU first, and in a ddpkit "
        "script it fails on CPU ranks.",
        "s.device with ddpkit, or torch.cuda.set_device(local_rank) and torch.device('cuda', local_rank)",
        hard_coded_cuda,
    ),
)
