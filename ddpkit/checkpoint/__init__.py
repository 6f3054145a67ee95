"""The checkpoint wing: save and resume the whole training state (`s.save` / `s.load`).

    checkpoints  the facade the session holds (`Checkpoints`): who writes, who waits, preemption's save
    resuming     a load: which checkpoint (rank 0 chooses, verifying), and its state restored on every rank
    write        a save's two phases: `capture` (every rank, in step) and `write` (files, manifest)
    background   the writer thread for `background=True`
    writer_process  the writer process for `background="process"` (out of training's interpreter)
    writer_child the writer process's own program (standard library only, run by path)
    staging      shared memory a process save's copy lands in, reused from save to save
    memory       memory snapshots in the host's keeper (`s.load(..., memory=N)`): save, agree, restore
    memory_hosts the keepers across hosts: buddy wiring through the store, why a recovery takes disk
    memory_cadence  how often a snapshot is taken (memory="auto": from the measured cost)
    retention    which checkpoints a save keeps: the newest K, every Nth, the best by a metric
    remote       an fsspec root (s3://...): the local commit uploaded, the manifest last; pulled to load
    sync         `CheckpointContext` (the typed values a save needs) and the ranks' agreement
    owners       what the wing needs from a strategy and the stepper, as protocols (`StateOwner`)
    divergence   which "shared" objects differ between ranks at a save (kept per rank then)
    state        what each keyword becomes (weights, loaders, RNGs, values)
    dcp          sharded (FSDP) state through torch.distributed.checkpoint
    portable     a sharded (FSDP) checkpoint loaded whole, under DDP or in one process
    gather       a sharded step's optimizer state, gathered behind training
    files        the directory layout, checksums, the manifest, `CheckpointError`
    reading      a checkpoint read offline, one tensor at a time (whole-model files or DCP shards)
    inspect      `ddpkit checkpoint inspect`: what a checkpoint holds, whether its checksums hold
    convert      `ddpkit checkpoint convert`: to safetensors, a Hugging Face folder, torch.save; and back
    cli          the `ddpkit checkpoint` command (reached from `ddpkit.cli` as a tool)

Owns: the bytes on disk and their meaning. May import the cluster, parallel and data wings, errors and
names; never the step (it sits above the strategies, which export through this wing), nor the training
facade (contract "facade"): the session passes its values in.
"""
