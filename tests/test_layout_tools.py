"""The tools read the one layout: checkpoints record it and `ddpkit checkpoint inspect` names it.

Pure functions, no process group: the manifest's record is the layout's own `as_dict`, and the header
`inspect` prints is composed from `Layout.describe`, so a checkpoint says the shape it was written at.
"""

from __future__ import annotations

from ddpkit.checkpoint import inspect
from ddpkit.parallel.layout import ClusterShape, Layout, build


def test_inspect_names_the_mesh_a_checkpoint_was_written_on() -> None:
    hsdp = build(("replicate", "shard"), ClusterShape(4, 2))
    manifest = {"step": 3, "strategy": "hsdp", "world_size": 4, "layout": hsdp.as_dict()}
    assert "step 3, written by hsdp (replicate 2 x shard 2) at world size 4" in inspect._header(manifest)


def test_inspect_of_a_one_dimensional_layout_or_an_older_checkpoint_reads_as_before() -> None:
    fsdp = build(("shard",), ClusterShape(2, 2))
    assert "written by fsdp at world size 2" in inspect._header(
        {"strategy": "fsdp", "world_size": 2, "layout": fsdp.as_dict()}
    )
    assert "written by ddp at world size 2" in inspect._header({"strategy": "ddp", "world_size": 2})
    assert Layout.from_dict(fsdp.as_dict()) == fsdp  # what the manifest records reads back the same
