"""`ddpkit lint`: a static check of training scripts for the known DDP traps (Python's `ast`, no execution).

    from ddpkit.lint import lint_source, lint_paths
    for finding in lint_source(open("train.py").read(), "train.py"):
        print(finding.render())       # train.py:12:5: DDP006 torch.save runs on every rank ... (fix: ...)

Rules are in `rules_model` (building and wrapping the model), `rules_ranks` (what each rank does) and
`rules_loop` (loss and sampler), `rules_idioms` (what a ported script brings), over `script` (a parsed
script), `models` (which expression is the model) and `optimizers` (which optimizer trains it);
`ddpkit lint --list-rules` and docs/lint.md describe each. Precision comes first: a rule stays silent
when the script does not show enough to be sure.

Owns: the rules and their findings; it runs nothing of the script.
May import `ddpkit` and its public modules only (the `tools` contract in `.importlinter`): never
the session, the checkpoint wing or the step's and cluster's internals.
"""

from __future__ import annotations

from ddpkit.lint.rules import Finding, Rule, all_rules
from ddpkit.lint.runner import Unreadable, lint_paths, lint_source, select_rules

__all__ = ["Finding", "Rule", "Unreadable", "all_rules", "lint_paths", "lint_source", "select_rules"]
