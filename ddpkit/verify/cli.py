"""`ddpkit verify`: check that DDP trains the same weights as one process, on your own model.

    ddpkit verify --model mypkg.nets:make_net --data mypkg.data:make_train            # SGD, 2 ranks
    ddpkit verify --model nets:make_net --data data:train --optimizer adamw --lr 3e-4 --steps 20
    ddpkit verify --model nets:make_net --batches data:batch_of_step --loss mse --json report.json
    ddpkit verify ... --sync-batchnorm            # check the fix the diagnosis suggests
    ddpkit verify ... --compile                   # DDP/FSDP + torch.compile against one eager process
    ddpkit verify ... --strategy hsdp --nproc 4   # HSDP: 2 replicas x 2 shards (--shard-degree N)
    ddpkit verify ... --resume --setup train:setup --save-at 5    # save, restart, load: all state saved?
    ddpkit verify ... --resume --strategy hsdp --nproc 4 --resume-strategy fsdp --resume-nproc 2  # reshaped
    ddpkit verify ... --bitwise --chunk 4         # reproducible="any-world": 1 rank = N ranks, bit for bit
    ddpkit verify --resume-script train.py --save-at 5 -- --out ckpt   # your own script, killed and resumed

`module:function` references are imported from the current folder (or PYTHONPATH) in every process.
Exit status: 0 when DDP matches, 1 when it does not (the report says why), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddpkit import strategy as strategies
from ddpkit.errors import problem
from ddpkit.parallel import layout as layouts
from ddpkit.verify.checker import verify
from ddpkit.verify.shapes import given_degrees
from ddpkit.verify.spec import LOSSES, OPTIMIZERS, PRECISIONS, Tolerance, VerifySpec

# The help of each layout degree's flags (`--<degree>-degree`, `--resume-<degree>-degree`); a degree
# added to `TOOL_DEGREES` gets its flags with the generic help.
DEGREE_HELP = {"shard": "--strategy hsdp: ranks per shard group (default nproc / 2: 2 replicas)"}
RESUME_DEGREE_HELP = {"shard": "--resume-strategy hsdp: ranks per shard group after the restart"}


def add_degree_flags(p: argparse.ArgumentParser, prefix: str, helps: dict[str, str]) -> None:
    """`--<prefix><degree>-degree` for every degree the tools take (`parallel.layout.TOOL_DEGREES`)."""
    for degree in layouts.TOOL_DEGREES:
        p.add_argument(
            f"--{prefix}{degree}-degree",
            type=int,
            default=None,
            help=helps.get(degree, f"ranks per {degree} group (default: the strategy's own rule)"),
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpkit verify",
        description="Train K steps in one process on the global batch and K steps with DDP on N ranks, "
        "compare every parameter and buffer after every step against the measured noise floor.",
    )
    p.add_argument("--model", required=True, help="module:function returning the nn.Module")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="module:function returning a map-style or iterable Dataset")
    source.add_argument("--batches", help="module:function(step) returning the global batch of that step")
    p.add_argument(
        "--loss", default="cross_entropy", help=f"{', '.join(LOSSES)} or module:function(model, batch)"
    )
    p.add_argument("--optimizer", default="sgd", help=f"{', '.join(OPTIMIZERS)} or module:function(params)")
    p.add_argument("--lr", type=float, default=None, help="built-in optimizers: learning rate")
    p.add_argument("--momentum", type=float, default=None, help="sgd: momentum")
    p.add_argument("--weight-decay", type=float, default=None, help="built-in optimizers: weight decay")
    p.add_argument("--nproc", type=int, default=2, help="DDP ranks (default 2)")
    p.add_argument("--steps", type=int, default=10, help="training steps compared (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="the global batch (default 32)")
    p.add_argument("--no-shuffle", action="store_true", help="read --data in order")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    p.add_argument(
        "--strategy", choices=strategies.distributed(), default="ddp", help="the N-rank side (default ddp)"
    )
    add_degree_flags(p, "", DEGREE_HELP)
    p.add_argument("--sync-batchnorm", action="store_true", help="s.model(..., sync_batchnorm=True)")
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--compile", action="store_true", help="DDP/FSDP side: s.model(..., compile=True)")
    p.add_argument(
        "--shard-optimizer",
        choices=("true", "auto", "gradients"),
        default=None,
        help="both sides step with s.step(opt) in session(shard_optimizer=...); 'gradients': "
        "the reduce-scatter step",
    )
    p.add_argument("--after-wrap", default=None, help="module:function(module, session) run after s.model")
    p.add_argument(
        "--floor",
        default="permuted,chunked",
        help="noise-floor variants: permuted, chunked, threads (comma list)",
    )
    p.add_argument("--floor-multiple", type=float, default=Tolerance().floor_multiple)
    p.add_argument("--eps-multiple", type=float, default=Tolerance().eps_multiple)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the DDP run")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON ('-': stdout only)")
    p.add_argument(
        "--locate",
        action="store_true",
        help="find the first step, module and operation (forward or backward) at which the ranks part "
        "from one process (ddpkit.verify.locate)",
    )
    p.add_argument(
        "--resume", action="store_true", help="check save -> restart -> load (ddpkit.verify.resume)"
    )
    p.add_argument("--resume-nproc", type=int, default=None, help="--resume: ranks after the restart")
    p.add_argument(
        "--resume-strategy",
        choices=strategies.distributed(),
        default=None,
        help="--resume: the strategy after the restart (default --strategy's)",
    )
    add_degree_flags(p, "resume-", RESUME_DEGREE_HELP)
    p.add_argument("--save-at", type=int, default=None, help="--resume: the step saved (default steps // 2)")
    p.add_argument(
        "--setup", default=None, help="--resume: module:function(s, model, opt, loader) -> Resumable"
    )
    p.add_argument(
        "--bitwise",
        action="store_true",
        help="check reproducible='any-world' (verify.bitwise): 1 rank vs --nproc, bit for bit",
    )
    p.add_argument("--chunk", type=int, default=4, help="--bitwise: samples per chunk (default 4)")
    return p


def spec_from_args(ns: argparse.Namespace) -> VerifySpec:
    options = {
        key: value
        for key, value in (("lr", ns.lr), ("momentum", ns.momentum), ("weight_decay", ns.weight_decay))
        if value is not None
    }
    return VerifySpec(
        model=ns.model,
        data=ns.data,
        batches=ns.batches,
        loss=ns.loss,
        optimizer=ns.optimizer,
        optimizer_options=options,
        nproc=ns.nproc,
        steps=ns.steps,
        batch_size=ns.batch_size,
        shuffle=not ns.no_shuffle,
        precision=ns.precision,
        seed=ns.seed,
        device=ns.device,
        sync_batchnorm=ns.sync_batchnorm,
        find_unused_parameters=ns.find_unused_parameters,
        static_graph=ns.static_graph,
        strategy=ns.strategy,
        shard=ns.shard_degree,
        other_degrees=tuple((d, v) for d, v in given_degrees(ns).items() if d != "shard" and v is not None),
        compile=ns.compile,
        shard_optimizer={"true": True, None: None}.get(ns.shard_optimizer, ns.shard_optimizer),
        after_wrap=ns.after_wrap,
        floor=tuple(v.strip() for v in ns.floor.split(",") if v.strip()),
        tolerance=Tolerance(floor_multiple=ns.floor_multiple, eps_multiple=ns.eps_multiple),
        timeout=ns.timeout,
    )


def main(argv: list[str]) -> int:
    """Entry point of `ddpkit verify`; returns 0 (same weights), 1 (they differ) or raises DdpkitError."""
    if argv[:1] == ["--"]:  # `ddpkit verify -- --model ...`: the separator the top-level parser needs
        argv = argv[1:]
    if "--resume-script" in argv:  # the user's own script: none of the model/data flags apply
        return script_main(argv)
    ns = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path:  # `module:function` from the current folder, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    if ns.strategy == "hsdp" and ns.bitwise:
        raise problem(
            "--bitwise runs its own check under DDP; --strategy hsdp would not be applied",
            "Check HSDP against one process with ddpkit verify --strategy hsdp, and the bitwise mode in "
            "a run of its own without --strategy",
        )
    if ns.resume:
        from ddpkit.verify import resume

        return resume.main(ns, spec_from_args(argparse.Namespace(**{**vars(ns), "nproc": max(2, ns.nproc)})))
    if ns.bitwise:
        from ddpkit.verify import bitwise

        checked = bitwise.check(spec_from_args(ns), chunk=ns.chunk)
        print(checked.render(), flush=True)
        return 0 if checked.passed else 1
    if ns.locate:
        from ddpkit.verify import locate

        found = locate.locate(spec_from_args(ns))
        print(found.render(), flush=True)
        return 1 if found.found or found.error else 0
    report = verify(spec_from_args(ns))
    if ns.json == "-":
        print(report.to_json())
    else:
        print(report.render(), flush=True)
        if ns.json:
            Path(ns.json).write_text(report.to_json() + "\n")
        if not report.passed:
            print(LOCATE_HINT, flush=True)
    return 0 if report.passed else 1


LOCATE_HINT = (
    "ddpkit: to find the first step, module and operation where they part, run the same command with --locate"
)


def script_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpkit verify --resume-script",
        description="Run your training script uninterrupted and stopped at a step then resumed (each under "
        "ddpkit run, in a folder of its own), compare its last checkpoints bitwise and name what was not "
        "restored (ddpkit.verify.script_resume).",
    )
    p.add_argument("--resume-script", required=True, metavar="SCRIPT", help="the training script")
    p.add_argument("--nproc", type=int, default=2, help="ranks of every run (default 2)")
    p.add_argument("--save-at", type=int, default=2, help="the optimizer step to stop at (default 2)")
    p.add_argument(
        "--stop",
        choices=("kill", "signal"),
        default="kill",
        help="kill: as kill -9 (resume from the script's own newest checkpoint); signal: ddpkit's "
        "preemption (saved at the next step boundary, exit 75)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each run of the script")
    p.add_argument(
        "--workdir", default=None, help="where the runs' folders go (default: a new temporary one)"
    )
    p.add_argument(
        "args", nargs=argparse.REMAINDER, help="-- then the script's own arguments ({run}: its folder)"
    )
    return p


def script_main(argv: list[str]) -> int:
    from ddpkit.verify.script_resume import ScriptRun, check_script

    ns = script_parser().parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    run = ScriptRun(
        script=ns.resume_script,
        args=args,
        nproc=ns.nproc,
        stop_at=ns.save_at,
        how=ns.stop,
        timeout=ns.timeout,
        workdir=ns.workdir,
    )
    report = check_script(run)
    print(report.render(), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    from ddpkit.errors import DdpkitError

    try:
        sys.exit(main(sys.argv[1:]))
    except DdpkitError as err:
        print(f"ddpkit verify: error: {err}", file=sys.stderr)
        sys.exit(2)
