"""What a start-up meeting of the ranks that ran out of time says: who never arrived, where, and the fix.

    except dist.DistError as err:
        raise rendezvous_report.explain(err, rank=0, world_size=2, address="10.0.0.1:29500", timeout=600)

torch tells each of the three ways the meeting fails in its own terms, one traceback per rank:

- the rank hosting the store (rank 0 of a static rendezvous) waited for the others to connect:
  `DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined.` (the count
  includes the host itself);
- a rank could not reach the store: `DistNetworkError: The client socket has timed out after 600000ms
  while trying to connect to (10.0.0.1, 29500).`;
- every rank reached the store, but a peer never published its address to the backend (it started late,
  or stopped before `ddpkit.session`): `DistStoreError: wait timeout after 600000ms, keys:
  /ddpkit/attempt-0/0//cpu//0/1`, the key's last part being the rank waited for.

`explain` turns each into one paragraph naming the rendezvous_timeout, the address and the ranks (or the
count) that never came, ending with the fix; a store port already taken (`EADDRINUSE`) is said as such;
anything else keeps torch's words.
"""

from __future__ import annotations

import re

from ddpkit.errors import DdpkitError, problem

_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_CONNECT = re.compile(r"trying to connect to \(([^,]+), (\d+)\)")
_KEYS = re.compile(r"wait timeout after .*?keys: (.*)", re.S)


def explain(err: BaseException, *, rank: int, world_size: int, address: str, timeout: float) -> DdpkitError:
    """The paragraph for `err`, raised by torch while rank `rank` of `world_size` met the others at
    `address` (HOST:PORT) within `timeout` seconds."""
    text = str(err).strip()
    limit = f"rendezvous_timeout={timeout:g} s"
    fix = (
        f"Start all {world_size} ranks with the same address (`ddpkit run --nproc N script.py` on each "
        f"node, --rdzv-endpoint {address} for several), check that {address} is reachable from every host "
        "(a firewall, the interface: --local-addr), or give ranks that start late longer: "
        "ddpkit.session(rendezvous_timeout=SECONDS)"
    )
    joined = _JOINED.search(text)
    if joined:
        came, want = int(joined.group(1)), int(joined.group(2))
        return problem(
            f"the ranks did not meet within {limit}: rank {rank} hosts the rendezvous store at {address} "
            f"and only {came} of the {want} ranks reached it; {want - came} never arrived (not started, "
            "started late, or given another address)",
            fix,
        )
    connect = _CONNECT.search(text)
    if connect:
        where = f"{connect.group(1)}:{connect.group(2)}"
        return problem(
            f"the ranks did not meet within {limit}: rank {rank} could not reach the rendezvous store at "
            f"{where}, which rank 0 hosts; rank 0 never started there, or that address is not reachable "
            "from this host",
            fix,
        )
    keys = _KEYS.search(text)
    if keys:
        missing = sorted({int(m) for m in re.findall(r"/(\d+)(?=[\s,\]]|$)", keys.group(1))})
        who = f"rank(s) {', '.join(map(str, missing))}" if missing else "a rank"
        return problem(
            f"the ranks did not meet within {limit}: rank {rank} reached the rendezvous store at {address}, "
            f"but {who} of the {world_size} never joined the process group (started late, or stopped "
            "before ddpkit.session)",
            fix,
        )
    if "EADDRINUSE" in text or "failed to listen" in text:
        return problem(
            f"rank {rank} cannot host the rendezvous store at {address}: the port is taken (another job, or "
            "an earlier run still alive)",
            "Pass a free port (MASTER_PORT, or `ddpkit run --port P`), or leave it to `ddpkit run`, which "
            "lets the OS pick one on a single node",
        )
    return problem(f"the ranks could not meet at {address} (rendezvous_timeout={timeout:g} s): {text}", fix)
