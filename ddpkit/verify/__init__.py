"""`ddpkit verify`: prove that DDP over N ranks trains the same weights as one process, or say why not.

    from ddpkit.verify import VerifySpec, verify
    report = verify(VerifySpec(model=make_net, data=make_data, optimizer="adamw", nproc=2, steps=10))
    print(report.render())          # per-tensor table, replicas, diagnosis, verdict
    report.passed, report.to_json()

    ddpkit verify --model mypkg.nets:make_net --data mypkg.data:make_train --nproc 2 --steps 10

See docs/equivalence.md for what tolerance to expect and why the numbers differ at all.

Owns: the comparison of N ranks with one process, and its report.
May import `ddpkit` and its public modules only (the `tools` contract in `.importlinter`): never
the session, the checkpoint wing or the step's and cluster's internals.
"""

from ddpkit.verify.checker import compare, verify
from ddpkit.verify.report import Diagnosis, Report, TensorRow
from ddpkit.verify.spec import Tolerance, VerifySpec

__all__ = ["Diagnosis", "Report", "TensorRow", "Tolerance", "VerifySpec", "compare", "verify"]
