"""`ddpkit plan`: predict data-parallel step time, throughput and efficiency at N devices from one.

    ddpkit plan --workload gpt --max-gpus 256 --link ib-ndr          # presets: ddpkit plan --list-links
    ddpkit plan --workload mypkg.models:my_workload --link measured  # fit the link on this machine's ranks

profile.py runs the model on one device (forward, backward, when each DDP bucket's gradients are ready,
optimizer step); links.py holds the link presets and the fit of latency and bandwidth from `ddpkit bench
collectives`; simulate.py replays the backward with buckets launched as they become ready on one
communication stream; advice.py says what would help; report.py prints, writes JSON and the plot.

Owns: the prediction (profile, link model, simulation, advice).
May import `ddpkit` and its public modules only (the `tools` contract in `.importlinter`): never
the session, the checkpoint wing or the step's and cluster's internals.
"""
