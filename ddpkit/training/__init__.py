"""The training wing: the facade a script holds and the optional loop on top of it.

    opening.py     `ddpkit.session(...)`: the placement, limits and elastic accumulation, then a `Session`
    session.py     `Session`: seeds, output, the precision plan, the strategy (built once), the stepper
                   (made from named `StepParts`), `s.model`, `s.loader`, `s.save`/`s.load`, `s.log`
    choosing.py    the strategy, chosen once from `strategy=` and built once from the cluster's `Shape`
    fit.py         `ddpkit.fit(...)`: the optional loop (callbacks, non-finite losses, progress)
    fit_plan.py    what fit was asked to do, checked once (budget, evaluation, intervals)
    rollback.py    SpikeGuard(remedy="rollback") in fit: the last checkpoint loaded, the spike's data left out
    oom_retry.py   micro_batch='auto' in fit: a step out of memory re-run with its micro-batches split
    oom_ahead.py   micro_batch='auto' under FSDP: the split chosen before the first step, from an estimate
    callbacks.py   what fit's callbacks see and what it returns (`FitState`, `Callback`, `FitResult`)
    evaluation.py  `ddpkit.evaluate`: evaluation that keeps the ranks in step
    seeding.py     `seed_everything`: every generator a run draws from, seeded at once

Owns: what a user's script calls. May import every library wing below it (step, strategy, parallel,
cluster, checkpoint, observe, data, errors, names); nothing below imports it (`.importlinter`, contract
"facade"): lower layers get typed values, never the session. The public names live in `ddpkit` itself
(`ddpkit.session` is the function; this module is `ddpkit.training.session`).
"""
