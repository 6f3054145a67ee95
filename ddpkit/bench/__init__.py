"""`ddpkit bench`: measure collectives, scaling and tuning options on this machine (see `cli`)."""
