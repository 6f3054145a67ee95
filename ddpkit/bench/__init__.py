"""`ddpkit bench`: measure collectives, scaling and tuning options on this machine (see `cli`).

Owns: measurements of this machine and their reports.
May import `ddpkit` and its public modules only (the `tools` contract in `.importlinter`): never
the session, the checkpoint wing or the step's and cluster's internals.
"""
