"""`ddpkit verify`: prove that DDP over N ranks trains the same weights as one process, or say why not.

    from ddpkit.verify import VerifySpec, verify
    report = verify(VerifySpec(model=make_net, data=make_data, optimizer="adamw", nproc=2, steps=10))
    print(report.render())          # per-tensor table, replicas, diagnosis, verdict
    report.passed, report.to_json()

    ddpkit verify --model mypkg.nets:make_net --data mypkg.data:make_train --nproc 2 --steps 10

See docs/equivalence.md for what tolerance to expect and why the numbers differ at all.
"""

from ddpkit.verify.checker import compare, verify
from ddpkit.verify.report import Diagnosis, Report, TensorRow
from ddpkit.verify.spec import Tolerance, VerifySpec

__all__ = ["Diagnosis", "Report", "TensorRow", "Tolerance", "VerifySpec", "compare", "verify"]
