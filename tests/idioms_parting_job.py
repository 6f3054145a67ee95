"""A short loop whose one collective call sits under a rank test, for tests/test_idioms_parting_loop.py:

    ddpkit run --nproc W tests/idioms_parting_job.py CKPT CALL K

At optimizer step K (of 4) global rank 0 alone calls CALL (save: `s.save`, gather: `s.gather`,
any_rank: `s.any_rank`), as a port of a script whose checkpoint or logging block ran on rank 0 only.
"""

import sys

import torch
from torch import nn

import ddpkit

root, call, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
# The collective limit (600 s) and the save limit (60 s) are above the test's own bound: a refusal that
# waited for either would fail it.
with ddpkit.session(timeout=600, save_timeout=60, verbose=False) as s:
    model = s.model(nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(4):
        with s.accumulate(model):
            s.backward(model(torch.randn(8, 4)).sum())
        s.step(opt)
        if step == at and s.is_main:
            if call == "save":
                s.save(root, model=model, optimizer=opt, step=step)
            elif call == "gather":
                s.gather(torch.ones(2))
            else:
                s.any_rank(False)
